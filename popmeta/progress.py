"""The run's progress on the terminal: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, initial: int, every: int, stream=None):
        self.stream = stream or sys.stderr
        self.every = max(every, 1)
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, file=self.stream, unit="step", dynamic_ncols=True
            )

    def update(self, step: int, total: int, fields: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == total:
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"step {step}/{total} {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

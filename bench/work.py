"""What both sides of ``bench/estimators.py --peer`` run, and how both are timed.

Imported by popmeta's side (``bench/estimators.py``) and by learned_optimization's
(``bench/learned_optimization_peer.py``), which must not import popmeta: so
the shared shape of the work and the timing loop live here, standard library only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

#: Inner problems per estimate unless ``--tasks`` says otherwise: the CPU figures' population.
NUM_TASKS = 8
#: Every inner trajectory's length: a PES truncation's schedule, a FullES episode.
EPISODE_LENGTH = 50
#: Steps of one PES truncation.
TRUNCATION_LENGTH = 10
#: Standard deviation of the estimators' perturbations.
STD = 0.01
#: The image MLPs of (c) and (e): hidden widths and batch size, on the 8x8 digits.
IMAGE_MLPS = {"c": ((32,), 128), "e": ((256, 256), 512)}
#: Configurations learned_optimization has a namesake of.
NAMESAKES = ("a", "b", "c", "d", "e")


def median_rate(step: Callable[[], int], wait: Callable[[], None], seconds: float) -> float:
    """Calls per second, the median of rounds of at least a second each.

    Runs rounds for ``seconds`` and at least three. ``step`` makes some calls
    and returns how many (the clock is read between steps); each round ends
    with ``wait``, which blocks until the work dispatched is done. A shared
    machine's hiccups land in a few rounds, not in the median.
    """
    rates = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            count += step()
        wait()
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)

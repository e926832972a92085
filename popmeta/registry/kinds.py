"""A kind is one callable: its typed parameters are its config fields, its rules sit beside it.

A config section names its kind with ``kind``: a name registered in the
section's :class:`Registry`, or an import path ``module:attribute`` to a
callable of the user's. Either way the kind is a :class:`Kind`: the callable
that builds it, the fields read off its signature (a parameter's annotation
is the field's type, its default the field's default, ``Annotated[..., Range(...)]``
its range), and the rules that tie it to other sections. The config
validates a section against its kind's fields; the experiment calls the
callable with them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import operator
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

__all__ = [
    "REQUIRED",
    "Field",
    "Fraction",
    "Kind",
    "KindError",
    "NonNegativeFloat",
    "PositiveFloat",
    "PositiveInt",
    "Range",
    "Registry",
    "Rules",
]

T = TypeVar("T")

#: The default of a field the config must give.
REQUIRED: Any = inspect.Parameter.empty

#: A kind's cross-section rules: ``(config, dotted path of its section, the
#: section)`` -> ``(absolute dotted field, message)`` per problem.
Rules = Callable[[Any, str, Any], Iterator[tuple[str, str]]]

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

#: Top-level modules imported from a directory of a search path (not importable
#: as they were), and their files: the actors need them shipped.
_FOUND_BESIDE: dict[str, str | None] = {}


class KindError(ValueError):
    """A kind that cannot be named, imported or built; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a numeric field, as ``Annotated`` metadata: ``Annotated[int, Range(gt=0)]``."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of range, or None (None and a ``Literal``'s words are not checked)."""
        if value is None or isinstance(value, str):
            return None
        if self.gt is not None and not value > self.gt:
            return f"must be > {self.gt:g}, got {value!r}"
        if self.ge is not None and not value >= self.ge:
            return f"must be >= {self.ge:g}, got {value!r}"
        if self.lt is not None and not value < self.lt:
            return f"must be < {self.lt:g}, got {value!r}"
        return None


PositiveInt = typing.Annotated[int, Range(gt=0)]
PositiveFloat = typing.Annotated[float, Range(gt=0)]
NonNegativeFloat = typing.Annotated[float, Range(ge=0)]
#: In [0, 1): decays, momentums.
Fraction = typing.Annotated[float, Range(ge=0, lt=1)]


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field of a kind.

    Attributes:
      name: the parameter's name, the field's key in the section.
      type: its annotation without ``Annotated`` (``Any`` where unannotated).
      default: its default, or :data:`REQUIRED`.
      ranges: the :class:`Range` metadata of its annotation.
      doc: its line in the callable's ``Args:`` docstring section, if any.
    """

    name: str
    type: Any
    default: Any
    ranges: tuple[Range, ...] = ()
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def out_of_range(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this field's ranges; None when it is within them."""
        return next((p for bound in self.ranges if (p := bound.problem(value)) is not None), None)

    def signature(self) -> str:
        """``name: type = default`` as the docs show it."""
        text = f"{self.name}: {_type_text(self.type)}"
        return text if self.required else f"{text} = {self.default!r}"


def _type_text(tp: Any) -> str:
    if tp is Any:
        return "any"
    if isinstance(tp, type):
        return tp.__name__
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(tp))
    return str(tp).replace("typing.", "")


_SECTIONS = ("Returns:", "Raises:", "Yields:", "Attributes:", "Example:", "Examples:", "Note:")


def _arg_docs(callable_: Callable[..., Any]) -> dict[str, str]:
    """``name -> description`` from a Google-style ``Args:`` docstring section."""
    doc = inspect.getdoc(callable_) or ""
    docs: dict[str, str] = {}
    in_args, current = False, None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:"):
            in_args = True
            continue
        if not in_args:
            continue
        if stripped in _SECTIONS:
            break
        match = re.match(r"^\s*(\w+)(?: \(.*?\))?: (.*)$", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and stripped:
            docs[current] += " " + stripped
    return docs


def _without_ranges(annotation: Any) -> tuple[Any, tuple[Range, ...]]:
    """The annotation without ``Annotated`` (also inside ``X | None``), and its ranges."""
    if typing.get_origin(annotation) is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        return inner, tuple(m for m in metadata if isinstance(m, Range))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_without_ranges(arg) for arg in typing.get_args(annotation)]
        ranges = tuple(r for _, rs in parts for r in rs)
        return functools.reduce(operator.or_, [tp for tp, _ in parts]), ranges
    return annotation, ()


def fields_of(callable_: Callable[..., Any], leading: int = 0) -> tuple[Field, ...]:
    """The fields of a callable: its parameters after the ``leading`` ones popmeta passes.

    ``*args`` and ``**kwargs`` are not fields. Annotations that cannot be
    resolved are taken as ``Any``.
    """
    target = callable_.__init__ if inspect.isclass(callable_) else callable_
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # forward references the module cannot resolve
        hints = {}
    parameters = list(inspect.signature(callable_).parameters.values())[leading:]
    docs = _arg_docs(callable_)
    fields = []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation, ranges = _without_ranges(hints.get(parameter.name, Any))
        fields.append(
            Field(
                parameter.name, annotation, parameter.default, ranges, docs.get(parameter.name, "")
            )
        )
    return tuple(fields)


@dataclasses.dataclass(frozen=True)
class Kind(Generic[T]):
    """A kind a config section can name.

    Attributes:
      name: what the config writes: a registered name or ``module:attribute``.
      summary: one line for ``popmeta kinds`` and the docs.
      build: the callable; called with the section's leading objects and fields.
      fields: its config fields.
      rules: its cross-section rules, if any.
      traits: facts other rules read (e.g. ``data_free`` for task families).
      found_in: for an import path whose module was importable only from a
        directory of the search path (beside the config), the module's file:
        the actors need it too (see ``population.runtime_env``).
    """

    name: str
    summary: str
    build: Callable[..., T]
    fields: tuple[Field, ...]
    rules: Rules | None = None
    traits: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    found_in: str | None = None

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    def call(self, *leading: Any, **fields: Any) -> T:
        """Builds this kind from Python: unknown fields and out-of-range values are refused.

        Raises:
          KindError: naming the field (values are not converted: a config
            does that when it is loaded).
        """
        for name, value in fields.items():
            field = self.field(name)
            if field is None:
                known = ", ".join(f.name for f in self.fields) or "none"
                raise KindError(f"{name}: not a field of kind {self.name!r} (its fields: {known})")
            if (problem := field.out_of_range(value)) is not None:
                raise KindError(f"{name}: {problem}")
        return self.build(*leading, **fields)


class Registry(Generic[T]):
    """The kinds of one config section, in registration order.

    Args:
      section: the config section that names one (``"task"``).
      title: what the kinds are, for the docs.
      builds: what a kind returns, for the docs and the check of what it built.
      returns: the type (or types) a kind's callable must return.
      leading: how many positional arguments popmeta passes before the fields
        (an estimator gets the truncated step and the truncation schedule).
    """

    def __init__(
        self,
        section: str,
        title: str,
        builds: str,
        returns: type | tuple[type, ...],
        leading: int = 0,
    ):
        self.section = section
        self.title = title
        self.builds = builds
        self.returns = returns
        self.leading = leading
        self._kinds: dict[str, Kind[T]] = {}
        self._by_users: set[str] = set()

    @property
    def field(self) -> str:
        """The dotted field that names a kind of this section."""
        return f"{self.section}.kind"

    def register(
        self, name: str, summary: str, *, rules: Rules | None = None, **traits: Any
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: the decorated callable becomes kind ``name`` (built-in kinds use it)."""

        def add(build: Callable[..., T]) -> Callable[..., T]:
            if name in self._kinds:
                raise ValueError(f"{self.field}: {name!r} is registered twice")
            self._kinds[name] = Kind(
                name, summary, build, fields_of(build, self.leading), rules, traits
            )
            return build

        return add

    def register_user_kind(self, build: Callable[..., T], name: str | None = None) -> Kind[T]:
        """Registers a user's callable under ``name`` (default its own name).

        A user's kind may be registered again under the same name (a
        notebook cell run twice); a built-in name may not be taken.
        """
        name = name or build.__name__
        if name in self._kinds and name not in self._by_users:
            raise ValueError(
                f"{self.field}: {name!r} is a built-in kind; register yours as another"
            )
        summary = (inspect.getdoc(build) or "").split("\n\n")[0].replace("\n", " ")
        kind = Kind(name, summary, build, fields_of(build, self.leading))
        self._kinds[name] = kind
        self._by_users.add(name)
        return kind

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._kinds)

    def __iter__(self) -> Iterator[Kind[T]]:
        return iter([kind for name, kind in self._kinds.items() if name not in self._by_users])

    def __contains__(self, name: object) -> bool:
        return name in self._kinds

    def resolve(self, name: str, search_path: tuple[str, ...] = ()) -> Kind[T]:
        """The kind ``name`` stands for: a registered one, or the callable at ``module:attribute``.

        Args:
          name: what the config wrote.
          search_path: directories to import user modules from when the
            module is not importable as it is (e.g. the config's own directory).

        Raises:
          KindError: naming the field, and the names or the import problem.
        """
        if name in self._kinds:
            return self._kinds[name]
        if not _IMPORT_PATH.match(name):
            choices = ", ".join(repr(n) for n in self._kinds)
            raise KindError(
                f"{self.field}: expected one of {choices}, or an import path module:attribute "
                f"to a callable of yours; got {name!r}"
            )
        build, found_in = _import(name, self.field, search_path)
        summary = (inspect.getdoc(build) or "").split("\n\n")[0].replace("\n", " ")
        return Kind(name, summary, build, fields_of(build, self.leading), found_in=found_in)

    def check_built(self, kind: Kind[T], built: Any) -> T:
        """``built``, if it is what this section's kinds return; else a :class:`KindError`."""
        if isinstance(built, self.returns):
            return built
        raise KindError(
            f"{self.field}: {kind.name!r} returned a {type(built).__name__}, not {self.builds}"
        )


def _import(
    path: str, field: str, search_path: tuple[str, ...]
) -> tuple[Callable[..., Any], str | None]:
    """The callable at ``path``, and the module's file if it came from ``search_path``."""
    module_name, _, attribute = path.partition(":")
    top_name = module_name.partition(".")[0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise KindError(f"{field}: importing {module_name!r} failed: {err}") from None
        module = _import_from(module_name, search_path, field, err)
        _FOUND_BESIDE[top_name] = _source_of(sys.modules[top_name])
    except Exception as err:  # the module itself raised
        raise KindError(
            f"{field}: importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from None
    found_in = _FOUND_BESIDE.get(top_name)
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise KindError(f"{field}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise KindError(f"{field}: {path!r} is a {type(target).__name__}, not a callable")
    return target, found_in


def _source_of(module: Any) -> str | None:
    """A module's file, or a package's directory: what Ray's ``py_modules`` ships."""
    paths = list(getattr(module, "__path__", []))
    if len(paths) == 1:
        return str(paths[0])
    return getattr(module, "__file__", None)


def _import_from(
    module_name: str, search_path: tuple[str, ...], field: str, err: ModuleNotFoundError
) -> Any:
    """Imports ``module_name`` from the first directory of ``search_path`` that has it."""
    for directory in search_path:
        if directory in sys.path:
            continue
        sys.path.append(directory)
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError:
            sys.path.remove(directory)
        except Exception as inner:
            sys.path.remove(directory)
            raise KindError(
                f"{field}: importing {module_name!r} failed: {type(inner).__name__}: {inner}"
            ) from None
    where = f" (nor in {', '.join(search_path)})" if search_path else ""
    raise KindError(
        f"{field}: cannot import module {module_name!r}: {err}{where}. Put it beside the "
        "config file, install it, or put its directory in population.runtime_env "
        "(working_dir or py_modules)"
    ) from None

"""Value kinds of strategy fields: type and range checks, normalization, prototxt spelling.

Each kind's ``check`` either returns the normalized value (ints for int fields, floats for
float fields, tuples for lists) or raises StrategyError naming the field, what it expects and
what it got. Checks are stricter than Paddle's: ``True`` is not an int, a float is not an int,
a bare string is not a list, NaN and infinities are not numbers.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy.names import closest
from fleetc.strategy.textformat import Word, quote


class Kind:
    """How one field's values are checked and written; subclasses fill in the details."""

    repeated = False

    def describe(self) -> str:
        """A short phrase for messages and docs, e.g. ``int >= 1``."""
        raise NotImplementedError

    def check(self, value: Any, path: str) -> Any:
        """Return ``value`` normalized, or raise StrategyError."""
        raise NotImplementedError

    def to_text(self, value: Any) -> list[str]:
        """The prototxt spelling of ``value``: one item per line to write (none for empty)."""
        return [str(value)]

    def from_text(self, value: Any, path: str) -> Any:
        """Check a value parsed from prototxt (a list of them when repeated)."""
        if isinstance(value, Word):
            raise StrategyError(f"{path} expects {self.describe()}, got the bare word {value}")
        return self.check(value, path)


def wrong_type_error(path: str, expected: str, value: Any) -> StrategyError:
    """The error for field `path` given a value of the wrong type: what it expects and what it got."""
    return StrategyError(f"{path} expects {expected}, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class Bounds:
    """Inclusive (ge, le) and exclusive (gt, lt) limits on a number."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def describe(self) -> str:
        parts = [f"{op} {limit}" for op, limit in
                 ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)) if limit is not None]
        return " and ".join(parts)

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


class Bool(Kind):
    """True or False; in prototxt ``true``/``false``."""

    def describe(self) -> str:
        return "bool"

    def check(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise wrong_type_error(path, "bool", value)
        return value

    def to_text(self, value: bool) -> list[str]:
        return ["true" if value else "false"]

    def from_text(self, value: Any, path: str) -> bool:
        spellings = {"true": True, "t": True, "false": False, "f": False}
        if isinstance(value, Word) and value.lower() in spellings:
            return spellings[value.lower()]
        if value in (0, 1) and not isinstance(value, (str, float)):
            return bool(value)
        raise StrategyError(f"{path} expects true or false, got {value!r}")


@dataclass(frozen=True)
class Int(Kind):
    """An integer (bool excluded), optionally bounded or limited to ``choices``."""

    bounds: Bounds = Bounds()
    choices: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.choices:
            return "int, one of " + ", ".join(map(str, self.choices))
        limits = self.bounds.describe()
        return f"int {limits}" if limits else "int"

    def check(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise wrong_type_error(path, "int", value)
        value = int(value)
        if self.choices and value not in self.choices:
            raise StrategyError(f"{path} must be one of {', '.join(map(str, self.choices))}, got {value}")
        if not self.bounds.holds(value):
            raise StrategyError(f"{path} must be {self.bounds.describe()}, got {value}")
        return value


@dataclass(frozen=True)
class Float(Kind):
    """A finite number stored as float; ints are accepted, bools are not."""

    bounds: Bounds = Bounds()

    def describe(self) -> str:
        limits = self.bounds.describe()
        return f"float {limits}" if limits else "float"

    def check(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong_type_error(path, "a number (float)", value)
        value = float(value)
        if not math.isfinite(value):
            raise StrategyError(f"{path} must be a finite number, got {value}")
        if not self.bounds.holds(value):
            raise StrategyError(f"{path} must be {self.bounds.describe()}, got {value!r}")
        return value

    def to_text(self, value: float) -> list[str]:
        return [repr(value)]


@dataclass(frozen=True)
class Choice(Kind):
    """One of a fixed set of strings; prototxt accepts it quoted or as a bare word."""

    choices: tuple[str, ...]

    def describe(self) -> str:
        return "one of " + ", ".join(map(repr, self.choices))

    def check(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise wrong_type_error(path, self.describe(), value)
        if value not in self.choices:
            hint = closest(value, self.choices)
            suggestion = f"; did you mean {hint!r}?" if hint else ""
            raise StrategyError(f"{path} must be {self.describe()}, got {value!r}{suggestion}")
        return str(value)

    def to_text(self, value: str) -> list[str]:
        return [quote(value)]

    def from_text(self, value: Any, path: str) -> str:
        return self.check(str(value) if isinstance(value, Word) else value, path)


class Text(Kind):
    """Free text (a path, a device name); prototxt writes it quoted."""

    def describe(self) -> str:
        return "a string"

    def check(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise wrong_type_error(path, self.describe(), value)
        return str(value)

    def to_text(self, value: str) -> list[str]:
        return [quote(value)]


@dataclass(frozen=True)
class Nullable(Kind):
    """``None`` (not set; never written to prototxt) or a value of the inner kind."""

    inner: Kind

    def describe(self) -> str:
        return f"{self.inner.describe()} or None"

    def check(self, value: Any, path: str) -> Any:
        return None if value is None else self.inner.check(value, path)

    def to_text(self, value: Any) -> list[str]:
        return [] if value is None else self.inner.to_text(value)

    def from_text(self, value: Any, path: str) -> Any:
        return self.inner.from_text(value, path)


@dataclass(frozen=True)
class ListOf(Kind):
    """A list of ``str`` or ``int`` items, stored as a tuple; a repeated field in prototxt."""

    item: type
    repeated = True

    def describe(self) -> str:
        return f"a list of {self.item.__name__}"

    def check(self, value: Any, path: str) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong_type_error(path, self.describe(), value)
        for item in value:
            if isinstance(item, bool) or not isinstance(item, self.item):
                raise StrategyError(f"{path} expects {self.describe()}, got item {item!r} "
                                    f"of type {type(item).__name__}")
            if item == "":
                raise StrategyError(f"{path} items must not be empty strings")
        return tuple(self.item(item) for item in value)

    def to_text(self, value: tuple) -> list[str]:
        return [quote(item) if self.item is str else str(item) for item in value]

    def from_text(self, value: list, path: str) -> tuple:
        for item in value:
            if isinstance(item, Word):
                raise StrategyError(f"{path} expects {self.describe()}, got the bare word {item}")
        return self.check(value, path)


class Checkpoints(ListOf):
    """Recompute checkpoints: a list of names, or ``"auto"`` to let fleetc choose them.

    A list holding only ``"auto"`` means the same as ``"auto"`` (that is how prototxt spells it);
    ``"auto"`` mixed with names is an error.
    """

    def __init__(self) -> None:
        super().__init__(str)

    def describe(self) -> str:
        return "a list of str, or 'auto'"

    def check(self, value: Any, path: str) -> tuple[str, ...] | str:
        if value == "auto":
            return "auto"
        names = super().check(value, path)
        if names == ("auto",):
            return "auto"
        if "auto" in names:
            raise StrategyError(f"{path}: 'auto' cannot be mixed with checkpoint names, got {list(names)}")
        return names

    def to_text(self, value: tuple[str, ...] | str) -> list[str]:
        return [quote(value)] if value == "auto" else super().to_text(value)

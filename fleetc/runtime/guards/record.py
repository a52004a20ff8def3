"""The guard record: what one compiled Program assumed about the world, as plain JSON data (never code).

Each guard is (kind, target, expected). The record travels with the Program (`metadata["guards"]`), prints in
`report()`, and is what an on-disk cache would key on.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleetc.ir.serialize import decode_value, encode_value

RECORD_VERSION = 1
# kind → what a guard of that kind holds; the order is the order of `report()` lines.
GUARD_KINDS = {
    "input": "shape, dtype, device and requires_grad of a tensor argument (the cache key)",
    "constant_arg": "value of a non-tensor argument, baked into the Program (the cache key)",
    "training": "the training flag of a module whose forward read it",
    "attribute": "a plain module attribute the step read",
    "module": "the class of the module at a path",
    "tensor": "the parameter or buffer under a name: the same tensor object (checked every step), its shape and dtype",
    "requires_grad": "a parameter's requires_grad flag",
    "param_group": "the parameters of an optimizer param group, in order",
    "hooks": "the hooks registered on the model, its parameters and the optimizer",
}


@dataclass(frozen=True)
class Guard:
    """One assumption: `target` (a module path, parameter name, argument, …) had the value `expected`."""

    kind: str
    target: str
    expected: Any

    def __post_init__(self) -> None:
        if self.kind not in GUARD_KINDS:
            raise ValueError(f"unknown guard kind {self.kind!r}; kinds: {', '.join(GUARD_KINDS)}")


_SUMMARISED_BY_COMMON_VALUE = ("training", "module", "tensor", "requires_grad")


def _brief(guard: Guard) -> str:
    """A guard's expected value in a few characters, for `summary()`."""
    if guard.kind == "tensor":
        return guard.expected["dtype"]  # shapes differ by tensor: the dtypes say more in one line
    if guard.kind == "input":
        shape = ", ".join(map(str, guard.expected["shape"]))
        grad = " requires_grad" if guard.expected["requires_grad"] else ""
        return f"{guard.expected['dtype']}[{shape}] {guard.expected['device']}{grad}"
    return repr(guard.expected)


@dataclass(frozen=True)
class GuardRecord:
    """Every guard of one compiled step (`step_kind` "train" or "eval")."""

    step_kind: str
    guards: tuple[Guard, ...]

    def of_kind(self, kind: str) -> list[Guard]:
        return [g for g in self.guards if g.kind == kind]

    def to_data(self) -> dict:
        """JSON-ready data; `from_data` gives back an equal record."""
        return {"guard_record": RECORD_VERSION, "step_kind": self.step_kind,
                "guards": [[g.kind, g.target, encode_value(g.expected, f"guard on {g.target}")] for g in self.guards]}

    @classmethod
    def from_data(cls, data: dict) -> GuardRecord:
        if not isinstance(data, dict) or data.get("guard_record") != RECORD_VERSION:
            raise ValueError(f"not a fleetc guard record of version {RECORD_VERSION}")
        return cls(data["step_kind"], tuple(Guard(kind, target, decode_value(expected))
                                            for kind, target, expected in data["guards"]))

    def to_json(self) -> str:
        return json.dumps(self.to_data(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GuardRecord:
        return cls.from_data(json.loads(text))

    def summary(self) -> list[str]:
        """One line per kind of guard: how many, and the values that are not the common one."""
        lines = []
        for kind in GUARD_KINDS:
            guards = self.of_kind(kind)
            if kind == "hooks":
                hooks = guards[0].expected if guards else {}
                lines.append("hooks: " + ("; ".join(f"{where}: {', '.join(names)}" for where, names in hooks.items())
                                          or "none registered"))
                continue
            if not guards:
                continue
            values = [_brief(g) for g in guards]
            if len(guards) <= 4 or kind not in _SUMMARISED_BY_COMMON_VALUE:
                detail = ", ".join(f"{g.target}={value}" for g, value in zip(guards[:6], values)) + (
                    ", …" if len(guards) > 6 else "")
            else:  # the common value once, then the exceptions
                common, _ = Counter(values).most_common(1)[0]
                odd = [f"{g.target}={value}" for g, value in zip(guards, values) if value != common]
                more = ", …" if len(odd) > 4 else ""
                detail = f"{common} except {', '.join(odd[:4])}{more}" if odd else f"{common} for all"
            lines.append(f"{kind} ({len(guards)}): {detail}")
        return lines

"""StrategyConfig, the frozen hashable form of any strategy object, and resolve_strategy that builds it.

Passes and the runtime read only StrategyConfig. Its attributes carry the DistributedStrategy
names (``cfg.gradient_merge_configs.k_steps``, ``cfg.build_strategy.fuse_bn_act_ops``); lists
are tuples. Equality and hashing cover the values only, not ``explicit_fields``, so equal
strategies give equal configs whatever way they were written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy import display
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA, DistributedStrategy
from fleetc.strategy.fields import BUILD_STRATEGY, EXECUTION_STRATEGY, Section
from fleetc.strategy.names import unknown_name
from fleetc.strategy.new_style import Strategy
from fleetc.strategy.views import BuildStrategy, ExecutionStrategy

_SCHEMA = DISTRIBUTED_SCHEMA


class ConfigSection:
    """One read-only section of a StrategyConfig (``cfg.amp_configs``), with attribute access."""

    __slots__ = ("_name", "_values")

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        if key not in self._values:
            raise unknown_name(key, f"{self._name} key", self._values)
        return self._values[key]

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self._name} is read-only; use StrategyConfig.replace()")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigSection):
            return NotImplemented
        return (self._name, self._values) == (other._name, other._values)

    def __hash__(self) -> int:
        return hash((self._name, tuple(self._values.items())))

    def __reduce__(self) -> tuple:
        return ConfigSection, (self._name, self._values)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class StrategyConfig(display.ShowsChanges):
    """An immutable, hashable, fully checked set of DistributedStrategy values.

    ``values`` maps dotted paths (``"amp"``, ``"amp_configs.incr_ratio"``) to values; missing
    paths take their defaults. ``explicit_fields`` are the dotted paths the user set, kept so
    reports can say "you set X, but Y"; they do not take part in equality or hashing.
    """

    __slots__ = ("_values", "_attributes", "explicit_fields")

    def __init__(self, values: Mapping[str, Any] | None = None, explicit_fields: Iterable[str] = ()) -> None:
        checked = dict(_SCHEMA.defaults)
        for path, value in (values or {}).items():
            checked[path] = _SCHEMA.validate(_known(path), value)
        explicit = frozenset(_known(path) for path in explicit_fields)
        attributes: dict[str, Any] = {}
        for entry in _SCHEMA.entries:
            if isinstance(entry, Section):
                attributes[entry.name] = ConfigSection(
                    entry.name, {f.name: checked[f"{entry.name}.{f.name}"] for f in entry.fields})
            else:
                attributes[entry.name] = checked[entry.name]
        object.__setattr__(self, "_values", checked)
        object.__setattr__(self, "_attributes", attributes)
        object.__setattr__(self, "explicit_fields", explicit)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._attributes:
            _SCHEMA.entry(name)  # raises UnknownFieldError with a hint
        return self._attributes[name]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StrategyConfig is immutable; use replace()")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._attributes))

    def get(self, path: str) -> Any:
        """The value at a dotted path, e.g. ``cfg.get("gradient_merge_configs.k_steps")``."""
        return self._values[_known(path)]

    def replace(self, changes: Mapping[str, Any]) -> StrategyConfig:
        """A copy with the values at the given dotted paths changed (and checked)."""
        return StrategyConfig({**self._values, **changes}, self.explicit_fields)

    def to_dict(self) -> dict[str, Any]:
        """All fields as the nested plain dict DistributedStrategy.from_dict accepts."""
        return _SCHEMA.nest(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StrategyConfig):
            return NotImplemented
        return self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __reduce__(self) -> tuple:
        return StrategyConfig, (self._values, self.explicit_fields)

    def _changed(self) -> list[display.Row]:
        return display.changed_rows(self._values, _SCHEMA.defaults)


def _known(path: str) -> str:
    if path not in _SCHEMA.fields:
        raise unknown_name(path, "strategy path", _SCHEMA.fields)
    return path


# Where the fields of each strategy class live among the DistributedStrategy paths.
_PREFIXES = ((DistributedStrategy, ""), (BuildStrategy, BUILD_STRATEGY.name + "."),
             (ExecutionStrategy, EXECUTION_STRATEGY.name + "."))

AnyStrategy = DistributedStrategy | BuildStrategy | ExecutionStrategy | Strategy | StrategyConfig | None


def resolve_strategy(strategy: AnyStrategy = None) -> StrategyConfig:
    """The StrategyConfig of any strategy object; None gives all defaults.

    A BuildStrategy or ExecutionStrategy sets only its own section. A newer-style Strategy maps
    onto the DistributedStrategy fields (sharding.degree -> sharding_configs.sharding_degree,
    fused_passes.gemm_epilogue -> build_strategy.fuse_gemm_epilogue while fused_passes.enable, ...).
    """
    if strategy is None:
        return StrategyConfig()
    if isinstance(strategy, StrategyConfig):
        return strategy
    if isinstance(strategy, Strategy):
        values, explicit = strategy._distributed_fields()
        return StrategyConfig(values, explicit)
    for cls, prefix in _PREFIXES:
        if isinstance(strategy, cls):
            return StrategyConfig({prefix + path: value for path, value in strategy._values().items()},
                                  {prefix + path for path in strategy._explicit()})
    raise StrategyError("resolve_strategy expects a DistributedStrategy, BuildStrategy, ExecutionStrategy, "
                        f"Strategy, StrategyConfig or None, got {type(strategy).__name__}")

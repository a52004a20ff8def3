"""Strategy: the newer ``paddle.distributed.Strategy`` (sections sharding, fused_passes, ...).

Its sections are built from the table ``fields.NEW_STYLE``: each key takes the kind, default and
meaning of the DistributedStrategy field it maps to, so both styles validate alike.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA
from fleetc.strategy.fields import NEW_STYLE, Field, Section
from fleetc.strategy.schema import Schema
from fleetc.strategy.views import FieldView


def _section(name: str, keys: tuple[tuple[str, str | Field], ...]) -> Section:
    fields = tuple(target if isinstance(target, Field) else
                   dataclasses.replace(DISTRIBUTED_SCHEMA.fields[target], name=key)
                   for key, target in keys)
    return Section(name, fields, f"{name} settings ({', '.join(key for key, _ in keys)})", as_object=True)


def _view_class(section: Section) -> type[FieldView]:
    class_name = "".join(part.capitalize() for part in section.name.split("_")) + "Config"
    namespace = {"__slots__": (), "__module__": __name__, "__doc__": f"The {section.doc} of a Strategy."}
    return types.new_class(class_name, (FieldView,),
                           {"schema": Schema(f"Strategy.{section.name}", section.fields)},
                           lambda ns: ns.update(namespace))


_SECTIONS = tuple(_section(name, keys) for name, _, keys in NEW_STYLE)


class Strategy(FieldView, schema=Schema("Strategy", _SECTIONS),
               object_views={section.name: _view_class(section) for section in _SECTIONS}):
    """Training optimizations in the newer Paddle style: ``Strategy({"sharding": {"enable": True}})``.

    Sections: sharding (enable, stage, degree), fused_passes (enable, gemm_epilogue, dropout_add),
    gradient_merge (enable, k_steps, avg), pipeline (enable, micro_batch_size, accumulate_steps,
    schedule_mode, vpp_degree), amp (enable and the amp_configs keys), recompute (enable and the
    recompute_configs keys). ``config`` sets the keys it names and leaves the rest at their
    defaults; ``strategy.sharding.stage = 2`` is checked like the DistributedStrategy field.
    fused_passes.gemm_epilogue and .dropout_add take effect only while fused_passes.enable is True.
    """

    __slots__ = ()

    def __init__(self, config: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        if config is not None:
            self._merge(config)

    def _distributed_fields(self) -> tuple[dict[str, Any], set[str]]:
        """The DistributedStrategy paths and values this strategy stands for, and which the user set."""
        own, own_explicit = self._values(), self._explicit()
        values: dict[str, Any] = {}
        explicit: set[str] = set()
        for name, gated, keys in NEW_STYLE:
            if gated and not own[f"{name}.enable"]:
                continue
            for key, target in keys:
                if isinstance(target, str):
                    values[target] = own[f"{name}.{key}"]
                    if f"{name}.{key}" in own_explicit:
                        explicit.add(target)
        return values, explicit

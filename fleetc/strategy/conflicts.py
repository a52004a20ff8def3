"""The one place where strategy combinations that cannot be honoured as given are settled."""

from __future__ import annotations

from dataclasses import dataclass

from fleetc.errors import StrategyError
from fleetc.strategy.config import StrategyConfig
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA
from fleetc.strategy.fields import Section

# (switch, its *_configs section), e.g. ("amp", amp_configs), read off the field table.
_SWITCHED_SECTIONS = tuple(
    (entry.name.removesuffix("_configs"), entry) for entry in DISTRIBUTED_SCHEMA.entries
    if isinstance(entry, Section) and entry.name.removesuffix("_configs") in DISTRIBUTED_SCHEMA.fields
)


@dataclass(frozen=True)
class Decision:
    """What resolve_conflicts did about one field (``action``: "switched off", "ignored") and why."""

    field: str
    action: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.action} ({self.reason})"


def resolve_conflicts(cfg: StrategyConfig) -> tuple[StrategyConfig, tuple[Decision, ...]]:
    """Apply the rules below to ``cfg``; return the config to compile and what was decided.

    The rules follow Paddle's meta-optimizer white and black lists, but report what Paddle did
    silently. In order:

    1. lars and lamb both on: StrategyError; they are two different optimizer updates and only
       the user can pick one.
    2. localsgd and adaptive_localsgd both on: localsgd is switched off; the adaptive variant is
       the same scheme with a tuned interval (Paddle black-lists the pair).
    3. gradient_merge (k_steps > 1) with pipeline: both stay on, and k_steps multiplies the update
       interval (docs/pipeline.md): one update every k_steps step() calls, each of accumulate_steps
       micro-batches. Reported, since the pipeline executor merges rather than the gradient_merge pass.
    4. gradient_merge with gradient_merge_configs.k_steps == 1: switched off; merging a single
       step is a plain step (Paddle does not apply it either).
    5. recompute with no checkpoints and no memory_budget_mb: switched off; there is nowhere to cut
       (give names, "auto" or a budget).
    6. a_sync set to True by the user: ignored in collective training; it applies to parameter-server
       training, whose trainer reports the mode it chose instead. Its default (True) alone is not reported.
    7. auto on: ignored; automatic strategy tuning is not implemented.
    8. keys of a ``*_configs`` section set while its switch is off: reported as ignored, so a
       forgotten ``strategy.amp = True`` is visible.
    """
    if cfg.lars and cfg.lamb:
        raise StrategyError("lars and lamb are both on, but they are two different optimizer updates; "
                            "switch one of them off")
    changes: dict[str, bool] = {}
    decisions: list[Decision] = []

    def switch_off(field: str, reason: str) -> None:
        changes[field] = False
        decisions.append(Decision(field, "switched off", reason))

    if cfg.gradient_merge and cfg.pipeline and cfg.gradient_merge_configs.k_steps > 1:
        k_steps, m = cfg.gradient_merge_configs.k_steps, cfg.pipeline_configs.accumulate_steps
        decisions.append(Decision("gradient_merge", "merged by the pipeline",
                                  f"with pipeline, k_steps multiplies the update interval: one update every {k_steps} "
                                  f"step() calls, i.e. every {k_steps} × {m} micro-batches"))
    if cfg.localsgd and cfg.adaptive_localsgd:
        switch_off("localsgd", "adaptive_localsgd is on, and it is local SGD with an adapted interval")
    if cfg.gradient_merge and cfg.gradient_merge_configs.k_steps == 1:
        switch_off("gradient_merge", "gradient_merge_configs.k_steps is 1, so there is nothing to merge")
    if cfg.recompute and cfg.recompute_configs.checkpoints == () and cfg.recompute_configs.memory_budget_mb is None:
        switch_off("recompute", "recompute_configs.checkpoints is empty; give checkpoint names, 'auto' "
                   "or memory_budget_mb")
    a_sync_keys = sorted(path.removeprefix("a_sync_configs.") for path in cfg.explicit_fields
                         if path.startswith("a_sync_configs."))
    if cfg.a_sync and ("a_sync" in cfg.explicit_fields or a_sync_keys):
        unused = f"; so a_sync_configs ({', '.join(a_sync_keys)}) is not used either" if a_sync_keys else ""
        decisions.append(Decision("a_sync", "ignored", "it is for parameter-server training; "
                                                       "collective training ignores it" + unused))
    if cfg.auto:
        decisions.append(Decision("auto", "ignored", "automatic strategy tuning is not implemented"))
    for switch, section in _SWITCHED_SECTIONS:
        keys = [f.name for f in section.fields if f"{section.name}.{f.name}" in cfg.explicit_fields]
        if keys and not cfg.get(switch):
            decisions.append(Decision(section.name, "ignored", f"{', '.join(keys)} set but {switch} is False"))
    return (cfg.replace(changes) if changes else cfg), tuple(decisions)

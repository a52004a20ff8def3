"""Turns user checkpoints (module paths or Var names) into a segment plan: sorted, validated, unused ones reported."""
from __future__ import annotations

import bisect
import difflib
from dataclasses import dataclass

from fleetc.errors import PassStrategyError
from fleetc.passes.recompute.plan import ForwardRegion, RecomputePlan

FIELD = "recompute_configs.checkpoints"


def _prefixes(module_path: str) -> list[str]:
    parts = module_path.split(".") if module_path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def module_outputs(region: ForwardRegion) -> dict[str, str]:
    """Module path → its output: the last value made inside the module that a forward op outside it reads."""
    best: dict[str, tuple[int, int, str]] = {}
    for op in region.ops:
        inside_reader = set(_prefixes(op.module_path))
        for name in op.inputs:
            producer = region.producer.get(name)
            if producer is None:
                continue
            rank = (region.index[producer.name], producer.outputs.index(name), name)
            for module in _prefixes(producer.module_path):
                if module not in inside_reader and rank > best.get(module, (-1, -1, "")):
                    best[module] = rank
    for op in region.ops:  # modules nothing outside reads in forward: their last value
        for module in _prefixes(op.module_path):
            if module not in best and op.defined:
                best[module] = (region.index[op.name], 0, op.defined[-1])
    return {module: rank[2] for module, rank in best.items()}


def resolve(region: ForwardRegion, names: tuple[str, ...], outputs: dict[str, str]) -> list[tuple[str, str]]:
    """(given name, forward value) per checkpoint; a name matching nothing raises StrategyError with candidates."""
    resolved = []
    for name in names:
        if name in outputs:
            resolved.append((name, outputs[name]))
        elif name in region.producer:
            resolved.append((name, name))
        else:
            candidates = sorted(outputs) + sorted(region.producer)
            close = difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
            what = ("names a parameter/state/backward Var, not a forward value"
                    if region.program.find_var(name) is not None else "matches no module path or forward Var")
            hint = f"closest valid checkpoints: {close}" if close else f"module paths: {sorted(outputs)[:20]}"
            raise PassStrategyError(f"{FIELD}: {name!r} {what}; {hint}")
    return resolved


@dataclass
class _Segments:
    """The rewrite that a list of checkpoint values (in forward order) implies."""

    saved: frozenset[str]
    group_of: dict[str, int]
    required: set[str]  # forward ops that get re-run
    crossing: set[str]  # values saved only because a later segment's re-run reads them
    reads_of_recomputed: set[str]

    def effect(self, region: ForwardRegion) -> tuple:
        """What the rewrite does: which ops re-run, grouped how, reading which forward values."""
        groups: dict[int, set[str]] = {}
        for name in self.required:
            groups.setdefault(self.group_of[name], set()).add(name)
        reads = (region.read_after | self.reads_of_recomputed) & self.saved
        return frozenset(self.required), frozenset(frozenset(g) for g in groups.values()), frozenset(reads)


def _segments(region: ForwardRegion, values: list[str]) -> _Segments:
    cut_positions = [region.index[region.producer[v].name] for v in values]
    group_of = {op.name: bisect.bisect_left(cut_positions, i) for i, op in enumerate(region.ops)
                if cut_positions and i <= cut_positions[-1]}
    base = frozenset(values) | {n for n in region.producer if region.must_save(n)}
    base |= {n for n, op in region.producer.items() if op.name not in group_of}

    def reads_of(ops: set[str]) -> set[str]:
        return {n for name in ops for n in region.recompute_inputs(region.ops[region.index[name]])}

    required = region.closure(region.read_after, base)
    crossing = {n for name in required for n in region.recompute_inputs(region.ops[region.index[name]])
                if n not in base and group_of.get(region.producer[n].name) != group_of[name]}
    saved = base | crossing
    required = region.closure(region.read_after, saved)
    reads = reads_of(required)
    return _Segments(saved, group_of, required, crossing & reads, reads)


def checkpoint_plan(region: ForwardRegion, names: tuple[str, ...], explain: bool = True) -> RecomputePlan:
    """Segments between consecutive checkpoints (inputs count as the first); the tail after the last stays saved.

    A checkpoint is unused when it repeats an earlier one or when leaving it out gives the same rewrite. Finding
    the second kind rebuilds the segments once per checkpoint; `explain=False` skips it (the plan's saved values
    and groups are the same, only its unused-checkpoint notes and `checkpoints` count may differ), so that a
    search can build many candidate plans in time linear in the region each.
    """
    outputs = module_outputs(region)
    resolved = resolve(region, names, outputs)
    notes: list[str] = []
    by_position = sorted(resolved, key=lambda pair: region.index[region.producer[pair[1]].name])
    if [n for n, _ in by_position] != [n for n, _ in resolved]:
        notes.append(f"checkpoints given out of order; sorted to forward order: {[n for n, _ in by_position]}")
    unused: dict[str, str] = {}
    firsts: list[tuple[str, str]] = []
    for given, value in by_position:
        if any(value == v for _, v in firsts):
            unused[given] = f"the same value ({value}) as an earlier checkpoint"
        else:
            firsts.append((given, value))
    values = [v for _, v in firsts]
    segments = _segments(region, values)
    effect = segments.effect(region)
    for given, value in firsts if explain else ():
        if _segments(region, [v for v in values if v != value]).effect(region) == effect:
            unused[given] = "leaving it out gives the same rewrite"
    notes += [f"unused checkpoint {given!r}: {why}" for given, why in unused.items()]
    module_of: dict[str, str] = {}
    for module, value in sorted(outputs.items(), key=lambda item: len(item[0])):
        module_of.setdefault(value, module)
    kept_across = {n: f"make it a checkpoint ({module_of.get(n, n)!r})"
                   for n in sorted(segments.crossing, key=lambda v: region.index[region.producer[v].name])}
    if kept_across:
        notes.append("kept alive across segment boundaries (read by a later segment's recompute): "
                     + "; ".join(f"{n}: {hint}" for n, hint in kept_across.items()))
    used = tuple(v for given, v in firsts if given not in unused)
    return RecomputePlan(segments.saved, segments.group_of, used, kept_across, notes, label=f"{len(used)} checkpoints")

"""AMP's dtype inference answered once per distinct op (issue 25: reuse of repeated blocks).

AMP learns an op's output dtypes by running it on fake tensors (`_CastRewriter.infer`), a few milliseconds per
op and most of the pass's time. The answer depends on nothing but the op's type, its constant arguments, and the
shape, dtype and device of each tensor it reads (or the value of each size it reads), so one answer serves every
op that agrees on all of these: the same layer in each copy of a repeated block, and repeated ops within a block.
The key holds every one of those inputs in full, so a reused answer is the one inference would give; the cast
decisions themselves (white/black lists, black Vars, fp16_guard regions) are still taken op by op.

On by default; `FLEETC_BLOCK_REUSE=0` turns it off (fleetc.ir.block_copies.reuse_enabled; tests compare the
Programs built both ways).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetc.ir.block_copies import reuse_enabled
from fleetc.ir.program import Op, map_refs
from fleetc.ir.repeated_blocks import block_instance


@dataclass(frozen=True)
class Input:
    """What fake inference sees of one Var argument: a tensor's shape, dtype and device, or a size's value."""

    shape: tuple | None
    dtype: str
    device: str | None
    value: Any = None


class DtypeMemo:
    """Output dtypes per (op type, arguments with each Var as its `Input`); counts per repeated block."""

    def __init__(self) -> None:
        self.enabled = reuse_enabled("amp")
        self.answers: dict[str, list | None] = {}
        self.hits: Counter = Counter()  # (prefix, instance) → inferences answered from the memo
        self.misses: Counter = Counter()  # (prefix, instance) → inferences run

    def infer(self, op: Op, args: tuple, kwargs: dict, describe: Callable[[str], Input],
              run: Callable[[], list | None]) -> list | None:
        """`run()`'s answer for `op` with these arguments, from the memo when an identical op asked before."""
        if not self.enabled:
            return run()
        describe_ref = lambda ref: describe(ref.name)
        key = repr((op.type, map_refs(args, describe_ref), map_refs(kwargs, describe_ref)))
        block = block_instance(op.module_path)
        if key in self.answers:
            self.hits[block] += 1
            return self.answers[key]
        self.misses[block] += 1
        self.answers[key] = answer = run()
        return answer

    def lines(self) -> list[str]:
        """`encoder.layers: 31 of 32 blocks took every dtype inference from an identical earlier op (…)`."""
        blocks: dict[str, list[str]] = {}
        for found in dict.fromkeys([*self.hits, *self.misses]):
            if found is not None:
                blocks.setdefault(found[0], []).append(found[1])
        result = []
        for prefix, instances in blocks.items():
            if len(instances) < 2:
                continue
            reused = [i for i in instances if not self.misses[(prefix, i)]]
            runs = sum(self.misses[(prefix, i)] for i in instances)
            hits = sum(self.hits[(prefix, i)] for i in instances)
            result.append(f"{prefix}: {len(reused)} of {len(instances)} blocks took every dtype inference from an "
                          f"identical earlier op ({runs} inferences run, {hits} reused)")
        return result

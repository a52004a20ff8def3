"""Checks, before a Program's first collective, that every rank will issue the same collectives in the same order.

gloo aborts the whole process when ranks disagree, so a disagreement must be caught first: each
rank hashes its Program's collective plan and the hashes are exchanged in one fixed-size gather.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from fleetc.comm.env import collective_timeout
from fleetc.comm.faults import collective_failed
from fleetc.errors import CollectiveError
from fleetc.ir.program import OpRole, Program, Ref


def collective_plan(program: Program) -> list[str]:
    """One line per collective op, in program order: type, constant arguments and the sizes it moves."""
    lines = []
    for block, op in program.walk_ops():
        if OpRole.COLLECTIVE not in op.role:
            continue
        sizes = [f"{v.dtype}{list(v.shape or ())}" for n in op.defined if (v := program.find_var(n, block.idx))]
        constants = [a for a in op.args if not isinstance(a, (Ref, list))]
        lines.append(f"{op.type} {constants} -> {sizes}")
    return lines


def _digest(lines: list[str]) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:8], "little", signed=True)


def check_plans_agree(program: Program) -> None:
    """Raise CollectiveError on every rank when any rank's collective plan differs from rank 0's."""
    plan = collective_plan(program)
    mine = torch.tensor([_digest(plan)], dtype=torch.int64)
    gathered = torch.empty(dist.get_world_size(), dtype=torch.int64)
    timeout = collective_timeout()
    try:
        dist.all_gather_single(gathered, mine, async_op=True).wait(timeout)
    except RuntimeError as exc:
        raise collective_failed("plan check (hash exchange before the first step)", exc,
                                timeout.total_seconds()) from exc
    differing = [r for r, h in enumerate(gathered.tolist()) if h != gathered[0].item()]
    if differing:
        raise CollectiveError(f"ranks would issue different collectives (gloo would abort): the plans of rank(s) "
                              f"{differing} differ from rank 0's. Every rank must compile the same model, strategy "
                              f"and input shapes. This rank ({dist.get_rank()}) plans {len(plan)} collective(s): "
                              + "; ".join(plan[:5]) + (" …" if len(plan) > 5 else ""))

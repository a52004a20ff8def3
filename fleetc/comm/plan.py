"""Checks, before a Program's first collective, that every rank will issue the same collectives in the same order.

gloo aborts the whole process when ranks disagree, so a disagreement must be caught first: each
rank hashes its Program's collective plan and the hashes are exchanged in one fixed-size gather.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from fleetc.comm.env import collective_timeout
from fleetc.comm.fake_group import skipped_under_fake_group
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


def check_ranks_agree(label: str, facts: dict[str, list[str]], advice: str) -> None:
    """Raise CollectiveError on every rank when any rank's `facts` (what → lines) differ from rank 0's.

    One fixed-size gather of a digest per kind of fact, bounded by the collective timeout: cheap, and a rank
    that is missing makes the others fail here (naming it), before anything could hang. Skipped (and recorded)
    under torch's fake process group, whose gather returns no digests (comm/fake_group.py).
    """
    if skipped_under_fake_group(label):
        return
    mine = torch.tensor([_digest(lines) for lines in facts.values()], dtype=torch.int64)
    gathered = torch.empty(dist.get_world_size() * len(facts), dtype=torch.int64)
    timeout = collective_timeout()
    try:
        dist.all_gather_single(gathered, mine, async_op=True).wait(timeout)
    except RuntimeError as exc:
        raise collective_failed(label, exc, timeout.total_seconds()) from exc
    by_rank = gathered.view(dist.get_world_size(), len(facts)).tolist()
    for column, (what, lines) in enumerate(facts.items()):
        differing = [r for r, digests in enumerate(by_rank) if digests[column] != by_rank[0][column]]
        if differing:
            raise CollectiveError(f"ranks disagree on {what}: rank(s) {differing} differ from rank 0. {advice} "
                                  f"This rank ({dist.get_rank()}) has {len(lines)} line(s): "
                                  + "; ".join(lines[:5]) + (" …" if len(lines) > 5 else ""))


def check_plans_agree(program: Program, settings: dict[str, list[str]] | None = None) -> None:
    """Raise CollectiveError on every rank when any rank's collective plan (or `settings`, e.g. the optimizer's
    hyperparameters) differs from rank 0's; gloo would abort the process, and differing settings diverge."""
    facts = {"the collectives to issue (different collectives would abort gloo)": collective_plan(program),
             **(settings or {})}
    check_ranks_agree("plan check (hash exchange before the first step)", facts,
                      "Every rank must compile the same model, strategy, optimizer settings and input shapes.")

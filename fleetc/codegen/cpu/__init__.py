"""The CPU backend: fused ops become generated C++ kernels, one loop nest each, built with the system compiler.

Which op types have CPU kernels is declared where each op is registered (`register_op(..., cpu_kernel=...)`
in fleetc/ops/); `backend.prepare` plans and builds them per Program, and this package lists their sources
for `dump-ir --kernels`.
"""
from __future__ import annotations

from fleetc.codegen.cpu.backend import planned_ops
from fleetc.codegen.cpu.plan import Unsupported
from fleetc.codegen.cpu.source import PRELUDE
from fleetc.ir.program import Program


def format_kernels(program: Program) -> str:
    """Every C++ kernel the CPU backend generates for `program` (each distinct source once, after the shared
    prelude), and the ops left to their reference with the reason; for `dump-ir --kernels`."""
    lines, seen = [], set()
    for op, plan in planned_ops(program):
        if isinstance(plan, Unsupported):
            lines.append(f"# {op.name} ({op.type}): no CPU kernel: {plan}\n")
            continue
        for kernel in plan.kernels:
            header = f"# {op.name} ({op.type}): kernel {kernel.name}  source sha256:{kernel.source_hash}"
            lines.append(header + ("  (as above)\n" if kernel.source_hash in seen else f"\n{kernel.code}"))
            seen.add(kernel.source_hash)
    if not lines:
        return "# no C++ kernels: the Program has no fused op with a CPU kernel (enable a fusion flag)\n"
    return "# C++ (CPU) kernels; every one starts with this prelude:\n" + PRELUDE + "\n" + "\n".join(lines)

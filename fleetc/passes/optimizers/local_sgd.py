"""`localsgd` / `adaptive_localsgd`: each data-parallel rank updates locally; parameters are averaged every k steps.

Paddle's LocalSGDOptimizer and AdaptiveLocalSGDOptimizer, on the Program IR. No gradient is
allreduced (insert_allreduce sees `metadata["local_sgd"]` and stands aside). After the update, a
step counter advances; on steps 1..begin_step, and afterwards whenever k_steps steps have passed
since the last average, a conditional block averages every parameter across ranks, one bucketed
allreduce per dtype (optimizer state stays local, as in Paddle). Paddle averages the ranks' deltas
from a snapshot taken at the last average; every rank's snapshot is that same average, so averaging
the parameters themselves is the same and needs no snapshot copy.

Adaptive (Wang & Joshi 2019, as Paddle implements it): on step 1 the loss averaged over ranks and the
learning rate (param group 0's) are remembered as loss_0 and lr_0 and k starts at init_k_steps; at
each average after begin_step the loss is averaged again (one more collective) and
k = clamp(ceil(sqrt(lr_0 * loss / (lr * loss_0) * init_k_steps)), 1, 16).

Counters (`trainer.counters`): `local_sgd@step`, `local_sgd@last_step`, `local_sgd@averages` (how many
averages ran), and for the adaptive variant `local_sgd@k_steps`, `local_sgd@loss_0`, `local_sgd@lr_0`,
`local_sgd@avg_loss`.
"""
from __future__ import annotations

from typing import Any

from fleetc.capture.to_program import LOSS_VAR
from fleetc.comm.collectives import FLAT
from fleetc.comm.groups import group_partitions
from fleetc.ir.program import CONDITIONAL_BLOCK, Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import data_parallel_world
from fleetc.passes.data_parallel.merged import allreduce_into_ops

PREFIX = "local_sgd"


class _Builder:
    """Vars and ops of the pass, with its standard attributes."""

    def __init__(self, program: Program, provenance: str):
        self.program = program
        self.provenance = provenance

    def counter(self, name: str, dtype: str, device: str) -> str:
        self.program.global_block.add_var(Var(f"{PREFIX}@{name}", (), dtype, device, VarKind.COUNTER))
        return f"{PREFIX}@{name}"

    def temp(self, block: Block, name: str, dtype: str) -> str:
        var = block.add_var(Var(self.program.unique_name(f"{PREFIX}@{name}"), (), dtype, "cpu"))
        return var.name

    def op(self, name: str, op_type: str, args: tuple, outputs: list[str], role: OpRole = OpRole.OPTIMIZE) -> Op:
        return Op(self.program.unique_name(f"{PREFIX}.{name}"), op_type, args, outputs=outputs,
                  attrs={"op_role": int(role), "module_path": "", "provenance": self.provenance})

    def conditional(self, name: str, condition: str, parent: Block, ops_of) -> Op:
        """A conditional_block running `ops_of(sub_block)` when `condition` holds."""
        sub = self.program.new_block(parent.idx)
        sub.ops = ops_of(sub)
        op = self.op(name, CONDITIONAL_BLOCK, (Ref(condition),), [])
        op.attrs["sub_block"] = sub.idx
        return op


class LocalSGD:
    name = "localsgd"
    enabled_by = "localsgd"
    summary = "no gradient allreduce: ranks update locally and average their parameters every k steps"
    reads = ("localsgd", "localsgd_configs")
    adaptive = False

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        adaptive, field = self.adaptive, self.name
        report = PassReport(self.name)
        world = data_parallel_world(program)
        optimizer = program.metadata.get("optimizer", {}).get("type")
        if world == 1:
            report.skipped_reason = "single process: nothing to average"
        elif optimizer != "SGD":
            report.skipped_reason = (f"{field} applies to SGD and Momentum (torch.optim.SGD) only, as in Paddle; "
                                     f"this Program's optimizer is {optimizer or 'none'}")
        elif "gradient_merge" in program.metadata:
            report.skipped_reason = f"{field} composes with AMP only, as in Paddle; gradient_merge is on"
        if report.skipped_reason:
            return program, report
        cfg = config.adaptive_localsgd_configs if adaptive else config.localsgd_configs
        k_steps = cfg.init_k_steps if adaptive else cfg.k_steps
        build = _Builder(program, self.name)
        params = [v.name for v in program.global_block.vars.values() if v.kind is VarKind.PARAM]
        by_dtype: dict[str, list[str]] = {}
        for name in params:
            by_dtype.setdefault(program.var(name).dtype, []).append(name)
        device = program.var(params[0]).device
        step, last = build.counter("step", "int64", device), build.counter("last_step", "int64", device)
        averages = build.counter("averages", "int64", device)
        block = program.global_block
        ops = [build.op("advance", "fleetc.increment", (Ref(step),), [step])]
        interval: Ref | int = k_steps
        if adaptive:
            state = {n: build.counter(n, dtype, device) for n, dtype in
                     (("k_steps", "int64"), ("loss_0", "float32"), ("lr_0", "float32"), ("avg_loss", "float32"))}
            interval = Ref(state["k_steps"])
            lr = next(f["var"] for f in program.metadata["optimizer"]["feeds"] if f.get("group") == 0
                      and f["key"] == "lr")
            first = build.temp(block, "first_step", "bool")
            ops += [build.op("is_first_step", "aten.eq.Scalar", (Ref(step), 1), [first]),
                    build.conditional("start", first, block, lambda sub: [
                        *self._average_loss(build, sub, state["avg_loss"]),
                        build.op("start_interval", "fleetc.adaptive_local_sgd_start",
                                 (Ref(state["loss_0"]), Ref(state["lr_0"]), Ref(state["k_steps"]),
                                  Ref(state["avg_loss"]), Ref(lr), k_steps),
                                 [state["loss_0"], state["lr_0"], state["k_steps"]])])]
        due = build.temp(block, "due", "bool")
        ops.append(build.op("due", "fleetc.local_sgd_due", (Ref(step), Ref(last), interval, cfg.begin_step), [due]))

        def average(sub: Block) -> list[Op]:
            body = []
            for index, names in enumerate(by_dtype.values()):
                body += allreduce_into_ops(program, sub, names, "", 0, FLAT, f"{PREFIX}_bucket{index}",
                                           build.provenance)
            body += [build.op("remember_step", "fleetc.assign", (Ref(last), Ref(step)), [last]),
                     build.op("count_average", "fleetc.increment", (Ref(averages),), [averages])]
            if adaptive:
                after_begin = build.temp(sub, "after_begin_step", "bool")
                body += [build.op("after_begin_step", "aten.gt.Scalar", (Ref(step), cfg.begin_step), [after_begin]),
                         build.conditional("adapt", after_begin, sub, lambda inner: [
                             *self._average_loss(build, inner, state["avg_loss"]),
                             build.op("adapt_interval", "fleetc.adapt_local_steps",
                                      (Ref(state["k_steps"]), Ref(state["lr_0"]), Ref(state["loss_0"]),
                                       Ref(state["avg_loss"]), Ref(lr), k_steps), [state["k_steps"]])])]
            return body

        ops.append(build.conditional("average", due, block, average))
        block.ops += ops
        program.metadata["local_sgd"] = {"adaptive": adaptive, "k_steps": k_steps, "begin_step": cfg.begin_step}
        program.metadata["collective_groups"] = group_partitions(world, 1, 1, False)
        report.changed = True
        per_average = len(by_dtype) + (1 if adaptive else 0)
        report.stats = {"params_averaged": len(params), "collectives_per_average": per_average,
                        "k_steps": k_steps, "begin_step": cfg.begin_step}
        interval_words = (f"k steps, k starting at {k_steps} and adapted from the loss averaged across ranks (1 more "
                          "collective per average)" if adaptive else f"{k_steps} steps")
        report.notes.append(
            f"no gradient allreduce: each rank updates locally; its {len(params)} parameters are averaged by "
            f"{len(by_dtype)} bucketed allreduce(s) on steps 1 to {cfg.begin_step}, then every {interval_words}; "
            f"trainer.counters['{averages}'] counts the averages")
        return program, report

    @staticmethod
    def _average_loss(build: _Builder, block: Block, avg_loss: str) -> list[Op]:
        """Copy this step's loss into `avg_loss` and average it across ranks."""
        return [build.op("copy_loss", "fleetc.assign", (Ref(avg_loss), Ref(build.program.fetches[LOSS_VAR])), [avg_loss]),
                *allreduce_into_ops(build.program, block, [avg_loss], "", 0, FLAT, f"{PREFIX}_loss", build.provenance)]


class AdaptiveLocalSGD(LocalSGD):
    name = "adaptive_localsgd"
    enabled_by = "adaptive_localsgd"
    summary = "local SGD whose averaging interval adapts to the loss (Wang & Joshi)"
    reads = ("adaptive_localsgd", "adaptive_localsgd_configs")
    adaptive = True

"""Split a training Program into per-stage Programs, one per phase of the pipeline schedule.

For each stage (model chunk) the plan holds:

- `forward`: the stage's forward ops for one micro-batch, starting with a `fleetc.pipeline_recv` of the previous
  stage's activations and ending with a `fleetc.pipeline_send` of what later stages read;
- `backward`: its whole backward for one micro-batch, between a receive of the next stage's gradients and a send
  to the previous stage; `backward_input` (B) and `backward_weight` (W) split it for zero-bubble schedules: B is
  what the previous stage waits for (the ops the sent gradients depend on), W the rest (parameter gradients);
- `optimizer`: the updates of the stage's parameters, reading the gradients summed over the micro-batches.

Messages relay: the activation message from stage s to s+1 carries every forward value computed on stages ≤ s that
a stage > s reads (skip connections hop stage by stage), and the gradient message from s+1 to s every value of
stages ≥ s+1 a stage ≤ s reads. Values that stay on a stage pass from one phase to the next as feeds: each phase
Program's feeds are what it reads and does not compute (the executor keeps them per micro-batch), its fetches
what later phases read, `grad:<name>` for gradients to sum over micro-batches and `loss` on the last stage.

The loss gradient is seeded with 1/m instead of 1, so the micro-batch gradients sum to the gradient of the mean
loss over the m micro-batches (Paddle scales each micro-batch's loss the same way). A parameter several stages read
(tied embeddings) is held by each of them: each sums its own part of the gradient over the micro-batches, and
`fleetc.pipeline_shared_sum` adds the parts across those stages before each copy is updated identically (Paddle's
shared-parameter sync). Under data parallel that sum comes first, then the stage's replicas average it with the
stage's other gradients (replicas.py); under sharding, each stage's optimizer Program is then sharded over the
stage's sharding group (sharded_stages.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fleetc.errors import PassError
from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.data_parallel.allreduce import name_full_precision_gradients
from fleetc.passes.pipeline_parallel.amp import (
    inline_skip_block,
    rewrap_skip_block,
    split_found_inf,
)
from fleetc.passes.pipeline_parallel.clip import split_clip_ops
from fleetc.passes.pipeline_parallel.replicas import (
    average_over_replicas,
    local_name,
    record_groups,
    replica_count,
)
from fleetc.passes.pipeline_parallel.sharded_stages import shard_stages
from fleetc.passes.pipeline_parallel.stages import (
    StageMap,
    annotated_stage,
    assign_stages,
    is_backward,
    is_forward,
    is_optimize,
    where,
)

PHASES = ("forward", "backward_input", "backward_weight", "backward", "optimizer")
ADD = "aten.add.Tensor"
LOSS_GRAD = "aten.ones_like.default"


@dataclass
class StagePrograms:
    """The Programs of one stage (model chunk), by phase, and the parameters it holds."""

    stage: int
    phases: dict[str, Program]
    params: list[str]

    def __str__(self) -> str:
        parts = [f"== stage {self.stage}: {len(self.params)} parameter(s) =="]
        for phase in [*PHASES, *(p for p in self.phases if p not in PHASES)]:  # sharding stage 3 adds "gather"
            parts.append(f"-- stage {self.stage} {phase} --\n{self.phases[phase]}")
        return "\n".join(parts)


@dataclass
class PipelinePlan:
    """Per-stage Programs, which parameters are shared between stages, and the messages at each boundary."""

    stages: list[StagePrograms]
    microbatches: int
    shared: dict[str, list[int]] = field(default_factory=dict)
    activations: list[list[str]] = field(default_factory=list)  # [s]: what stage s sends to s+1
    gradients: list[list[str]] = field(default_factory=list)    # [s]: what stage s sends to s-1 (s ≥ 1)
    replicas: int = 1  # data-parallel replicas of every stage (replicas.py)
    sharding: str = ""  # how each stage's optimizer Program is sharded (sharded_stages.py); "": not sharded

    def describe(self) -> str:
        """The split in words; the same on every rank (what the ranks compare before the first step)."""
        lines = [f"pipeline: {len(self.stages)} stage(s), {self.microbatches} micro-batch(es)"]
        # under sharding the optimizer (and stage 3's gather) Programs differ per rank: not counted then
        counted = ("backward_input", "backward_weight") + (("optimizer", "gather") if self.sharding else ())
        for s, stage in enumerate(self.stages):
            ops = sum(p.num_ops() for name, p in stage.phases.items() if name not in counted)
            lines.append(f"  stage {s}: {ops} ops{' before the optimizer' if self.sharding else ''}, "
                         f"{len(stage.params)} parameter(s)"
                         + (f"; sends {', '.join(self.activations[s])} forward" if self.activations[s] else "")
                         + (f"; sends {', '.join(self.gradients[s])} back" if self.gradients[s] else ""))
        for name, holders in sorted(self.shared.items()):
            lines.append(f"  shared parameter {name}: stages {', '.join(map(str, holders))}, gradients summed")
        if self.replicas > 1:
            lines.append(f"  each stage averages its summed gradients over {self.replicas} data-parallel replicas "
                         "(one allreduce per stage per step, in its optimizer Program)")
        if self.sharding:
            lines.append(f"  {self.sharding}")
        return "\n".join(lines)


def partition(program: Program, microbatches: int) -> PipelinePlan:
    """The PipelinePlan of a captured training Program annotated with device_guard stages."""
    work = program.clone()
    inline_skip_block(work)
    name_full_precision_gradients(work, list(work.metadata.get("optimizer", {}).get("grads", {}).values()))
    ops = work.global_block.ops
    for op in ops:
        if op.role & OpRole.COLLECTIVE:
            raise PassError(f"{where(op)}: this collective (sync_batch_norm, local SGD or a sharding bucket) cannot "
                            "be split across pipeline stages yet; switch that strategy off under pipeline (data "
                            "parallel itself composes: each stage averages its gradients in its optimizer Program)")
    _seed_loss_gradient(ops, microbatches)
    stage_map = assign_stages(work)
    shared = _split_shared_gradients(work, stage_map)
    stage_map = assign_stages(work)
    param_stages = _param_stages(work, stage_map, shared)
    split_clip_ops(work, param_stages, stage_map.count, split_found_inf(work, param_stages, stage_map.count))
    ops = work.global_block.ops
    opt_stages = _optimizer_stages(work, stage_map, param_stages)
    count = stage_map.count
    st = stage_map.stage
    reads_on: dict[str, set[int]] = {}
    for op in ops:
        for name in op.inputs:
            for s in opt_stages.get(op.name, {st.get(op.name, -1)}):
                reads_on.setdefault(name, set()).add(s)
    produced_on = {n: st[op.name] for op in ops if op.name in st for n in op.defined}
    forward_vars = {n for op in ops if is_forward(op) for n in op.defined}
    temp = {v.name for v in work.global_block.vars.values() if v.kind is VarKind.TEMP}
    activations = [sorted(n for n in forward_vars & temp if produced_on[n] <= s and max(reads_on.get(n, {-1})) > s)
                   for s in range(count)]
    gradients = [sorted(n for n in produced_on if n in temp and produced_on[n] >= s and min(reads_on.get(n, {count})) < s)
                 for s in range(count)]
    replicas = replica_count(work)
    stages = []
    for s in range(count):
        stages.append(_stage_programs(work, s, stage_map, opt_stages, activations, gradients, shared, param_stages,
                                      replicas))
    if replicas > 1:
        record_groups(program)
    sharding = shard_stages(program, stages)
    return PipelinePlan(stages, microbatches, shared, activations, gradients, replicas, sharding)


def _seed_loss_gradient(ops: list[Op], microbatches: int) -> None:
    """`loss@GRAD = ones_like(loss)` → `full_like(loss, 1/m)`: the micro-batch gradients then sum to the mean's."""
    seeds = [op for op in ops if op.type == LOSS_GRAD and op.role & OpRole.LOSS and op.role & OpRole.BACKWARD]
    if len(seeds) != 1:
        raise PassError(f"the pipeline split expects one loss-gradient seed ({LOSS_GRAD}, role backward|loss), "
                        f"found {len(seeds)}")
    seeds[0].type = "aten.full_like.default"
    seeds[0].args = (seeds[0].args[0], 1.0 / microbatches)


def _producers(ops: list[Op]) -> dict[str, Op]:
    return {name: op for op in ops for name in op.defined}


def _split_shared_gradients(program: Program, stage_map: StageMap) -> dict[str, list[int]]:
    """For each parameter read by the forward ops of several stages, replace the cross-stage sums that build its
    gradient by one partial sum per stage, `<grad>@stage<s>`, summed across the stages in the optimizer section."""
    ops = program.global_block.ops
    grads = program.metadata.get("optimizer", {}).get("grads", {})
    readers: dict[str, set[int]] = {}
    for op in ops:
        if is_forward(op):
            for name in op.inputs:
                var = program.find_var(name)
                if var is not None and var.kind is VarKind.PARAM:
                    readers.setdefault(name, set()).add(stage_map.stage[op.name])
    shared: dict[str, list[int]] = {}
    for param, stages in sorted(readers.items()):
        if len(stages) < 2 or param not in grads:
            continue
        producer = _producers(ops)
        removed: list[Op] = []
        leaves = _sum_leaves(grads[param], producer, stage_map, removed)
        holders = sorted(stages)
        by_stage: dict[int, list[str]] = {s: [] for s in holders}
        for leaf in leaves:
            s = stage_map.stage[producer[leaf].name]
            if s not in by_stage:
                raise PassError(f"part of the gradient of shared parameter {param!r} is computed on stage {s}, "
                                f"which does not read it")
            by_stage[s].append(leaf)
        removed_names = {op.name for op in removed}
        for op in ops:
            if op.name not in removed_names and not is_optimize(op) and any(o.defined[0] in op.inputs
                                                                            for o in removed):
                raise PassError(f"{where(op)} reads a partial sum of the gradient of shared parameter {param!r}")
        grad_var = program.var(grads[param])
        new_ops = [op for op in ops if op.name not in removed_names]
        for s, parts in by_stage.items():
            partial = program.global_block.add_var(Var(f"{grads[param]}@stage{s}", grad_var.shape, grad_var.dtype,
                                                       grad_var.device))
            if not parts:
                sum_op = Op(program.unique_name(f"{param}_zero_grad"), "aten.zeros_like.default", (Ref(param),),
                            outputs=[partial.name], attrs={"op_role": int(OpRole.BACKWARD), "op_device": f"stage:{s}"})
                new_ops.insert(_after_last_producer(new_ops, [param]), sum_op)
                continue
            total = parts[0]
            for i, part in enumerate(parts[1:]):
                out = partial.name if i == len(parts) - 2 else program.unique_name(f"{partial.name}_sum")
                if out != partial.name:
                    program.global_block.add_var(Var(out, grad_var.shape, grad_var.dtype, grad_var.device))
                add = Op(program.unique_name(f"{param}_grad_sum"), ADD, (Ref(total), Ref(part)), outputs=[out],
                         attrs={"op_role": int(OpRole.BACKWARD), "op_device": f"stage:{s}"})
                new_ops.insert(_after_last_producer(new_ops, [total, part]), add)
                total = out
            if total != partial.name:
                for op in new_ops:
                    if op.defined == [total]:
                        op.outputs = [partial.name]
                        op.attrs["op_device"] = f"stage:{s}"
        program.global_block.ops = new_ops
        shared[param] = holders
    return shared


def _after_last_producer(ops: list[Op], names: list[str]) -> int:
    last = -1
    for i, op in enumerate(ops):
        if any(n in op.defined for n in names):
            last = i
    return last + 1


def _sum_leaves(name: str, producer: dict[str, Op], stage_map: StageMap, removed: list[Op]) -> list[str]:
    """The terms of the add chain that builds `name`, expanding only sums whose terms come from several stages."""
    op = producer.get(name)
    if op is None or op.type != ADD or op.kwargs or not is_backward(op) or not all(isinstance(a, Ref) for a in op.args):
        return [name]
    taken: list[Op] = []
    leaves = _sum_leaves(op.args[0].name, producer, stage_map, taken) + _sum_leaves(op.args[1].name, producer,
                                                                                      stage_map, taken)
    if len({stage_map.stage[producer[leaf].name] for leaf in leaves if leaf in producer}) < 2:
        return [name]
    removed.extend([*taken, op])
    return leaves


def _param_stages(program: Program, stage_map: StageMap, shared: dict[str, list[int]]) -> dict[str, list[int]]:
    """Which stages hold each parameter: those whose forward reads it (else the stage computing its gradient)."""
    out: dict[str, list[int]] = {}
    grads = program.metadata.get("optimizer", {}).get("grads", {})
    producer = stage_map.producer
    for op in program.global_block.ops:
        if is_forward(op):
            for name in op.inputs:
                var = program.find_var(name)
                if var is not None and var.kind is VarKind.PARAM:
                    out.setdefault(name, [])
                    if stage_map.stage[op.name] not in out[name]:
                        out[name].append(stage_map.stage[op.name])
    for param, grad in grads.items():
        if param not in out:
            out[param] = [stage_map.stage[producer[grad].name]] if grad in producer else [0]
        elif param not in shared and grad in producer and stage_map.stage[producer[grad].name] != out[param][0]:
            raise PassError(f"the gradient of {param!r} is computed on stage {stage_map.stage[producer[grad].name]} "
                            f"but the parameter is read on stage {out[param][0]}")
    return {k: sorted(v) for k, v in out.items()}


def _optimizer_stages(program: Program, stage_map: StageMap, param_stages: dict[str, list[int]]) -> dict[str, set[int]]:
    """Each optimizer op runs on the stages holding the parameter it reads or writes; an op touching no parameter
    (shared hyperparameter arithmetic) runs wherever an update reads its results, else on every stage."""
    ops = [op for op in program.global_block.ops if is_optimize(op)]
    placed: dict[str, set[int]] = {}
    readers: dict[str, list[Op]] = {}
    for op in ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op)
    for op in reversed(ops):
        if annotated_stage(op) is not None:  # placed by the split already (clip.py)
            placed[op.name] = {annotated_stage(op)}
            continue
        touched = [n for n in [*op.inputs, *op.defined] if n in param_stages]
        stages = {s for n in touched for s in param_stages[n]}
        if touched and len({tuple(param_stages[n]) for n in touched}) > 1:
            raise PassError(f"{where(op)} updates parameters of several pipeline stages at once (a fused "
                            "update); it cannot be split across stages yet")
        if not stages:
            stages = {s for n in op.defined for r in readers.get(n, ()) for s in placed.get(r.name, ())}
        placed[op.name] = stages or set(range(stage_map.count))
    return placed


def _stage_programs(program: Program, s: int, stage_map: StageMap, opt_stages: dict[str, set[int]],
                    activations: list[list[str]], gradients: list[list[str]], shared: dict[str, list[int]],
                    param_stages: dict[str, list[int]], replicas: int) -> StagePrograms:
    ops = program.global_block.ops
    st = stage_map.stage
    count = stage_map.count
    forward = [op for op in ops if is_forward(op) and st[op.name] == s]
    backward = [op for op in ops if is_backward(op) and st[op.name] == s]
    optimizer = [op for op in ops if is_optimize(op) and s in opt_stages[op.name]]
    sends_back = gradients[s] if s > 0 else []
    b_ops = _closure(backward, {n for n in sends_back})
    w_ops = [op for op in backward if op not in b_ops]
    grads = program.metadata.get("optimizer", {}).get("grads", {})
    grad_fetch = {}  # the executor's micro-batch sum key → the gradient the backward defines
    held = []        # the gradients the optimizer Program updates with (averaged over replicas first)
    for param, grad in grads.items():
        if param in shared and s in shared[param]:
            grad_fetch[f"{grad}@stage{s}"] = f"{grad}@stage{s}"
            held.append(grad)
        elif param not in shared and s in param_stages.get(param, ()):
            grad_fetch[local_name(grad, replicas)] = grad
            held.append(grad)
    recv_act = recv_ops(program, activations[s - 1], s - 1, "activation") if s > 0 else []
    send_act = send_ops(activations[s], s + 1, "activation") if s < count - 1 else []
    recv_grad = recv_ops(program, gradients[s + 1], s + 1, "gradient") if s < count - 1 else []
    send_grad = send_ops(sends_back, s - 1, "gradient") if s > 0 else []
    # a shared parameter's parts are summed over its stages first (each replica's own), then averaged over the
    # replicas with the stage's other gradients: every gradient then takes one path, which sharding rewrites
    shared_sums = [_shared_sum(program, grads[p], s, holders, local_name(grads[p], replicas))
                   for p, holders in sorted(shared.items()) if s in holders]
    averaged = average_over_replicas(program, s, sorted(held)) if replicas > 1 and held else []
    optimizer_ops = [*shared_sums, *averaged, *optimizer]
    bodies = {
        "forward": recv_act + forward + send_act,
        "backward_input": recv_grad + b_ops + send_grad,
        "backward_weight": w_ops,
        "backward": recv_grad + backward + send_grad,
        "optimizer": optimizer_ops,
    }
    later = {"forward": ("backward",), "backward_input": ("backward_weight",), "backward_weight": (),
             "backward": (), "optimizer": ()}
    phases = {}
    for phase, body in bodies.items():
        read_later = {n for other in later[phase] for op in bodies[other] for n in op.inputs}
        if phase == "forward":
            read_later |= {n for op in bodies["backward_input"] + bodies["backward_weight"] for n in op.inputs}
        fetches = {}
        if phase == "forward" and program.fetches.get("loss") in {n for op in body for n in op.defined}:
            fetches["loss"] = program.fetches["loss"]
        defined = {n for op in body for n in op.defined}
        for name in sorted(defined & read_later):
            fetches[name] = name
        if phase in ("backward", "backward_weight", "backward_input"):
            for key, name in grad_fetch.items():
                if name in defined:
                    fetches[f"grad:{key}"] = name
        phases[phase] = sub_program(program, body, fetches, f"pipeline stage {s} {phase}")
    rewrap_skip_block(phases["optimizer"])
    params = sorted(p for p, holders in param_stages.items() if s in holders)
    return StagePrograms(s, phases, params)


def _closure(ops: list[Op], wanted: set[str]) -> list[Op]:
    """The ops of `ops` that (transitively) compute `wanted`, in order."""
    need = set(wanted)
    keep = []
    for op in reversed(ops):
        if need & set(op.defined):
            keep.append(op)
            need |= set(op.inputs)
    return list(reversed(keep))


def recv_ops(program: Program, names: list[str], peer: int, tag: str) -> list[Op]:
    """The `fleetc.pipeline_recv` op that defines `names` (shapes and dtypes from `program`), sent by stage `peer`
    under `tag` ("activation" or "gradient"); shared by training (here) and forward-only pipelining."""
    shapes = [list(program.var(n).shape or ()) for n in names]
    dtypes = [program.var(n).dtype for n in names]
    return [Op(f"recv_{tag}_from_{peer}", "fleetc.pipeline_recv", (peer, tag, shapes, dtypes), outputs=list(names),
               attrs={"op_role": int(OpRole.COLLECTIVE)})]


def send_ops(names: list[str], peer: int, tag: str) -> list[Op]:
    """The `fleetc.pipeline_send` op that sends `names` to stage `peer` under `tag` (the matching `recv_ops`)."""
    return [Op(f"send_{tag}_to_{peer}", "fleetc.pipeline_send", ([Ref(n) for n in names], peer, tag),
               attrs={"op_role": int(OpRole.COLLECTIVE)})]


def _shared_sum(program: Program, grad: str, s: int, holders: list[int], out: str) -> Op:
    return Op(f"{grad}@shared_sum", "fleetc.pipeline_shared_sum", (Ref(f"{grad}@stage{s}"), holders, f"shared:{grad}"),
              outputs=[out], attrs={"op_role": int(OpRole.OPTIMIZE | OpRole.COLLECTIVE)})


def sub_program(program: Program, ops: list[Op], fetches: dict[str, str], kind: str) -> Program:
    """A Program of `ops` (copied) with these `fetches` and `metadata["kind"] = kind`: what they read and do not
    compute becomes a feed (DATA, or HYPER as it was). One stage's Program, in training and forward-only pipelining."""
    sub = Program()
    sub.metadata = {"kind": kind}
    block: Block = sub.global_block
    defined: set[str] = set()
    for op in ops:
        for name in op.inputs:
            var = program.find_var(name)
            if var is None:
                raise PassError(f"{where(op)} reads {name!r}, which the Program does not declare")
            if name not in block.vars:
                copy = Var(var.name, var.shape, var.dtype, var.device, var.kind)
                if not var.persistable and name not in defined:
                    copy.kind = VarKind.HYPER if var.kind is VarKind.HYPER else VarKind.DATA
                    sub.feeds.append(name)
                block.add_var(copy)
        for name in op.defined:
            if name not in block.vars:
                var = program.var(name)
                block.add_var(Var(var.name, var.shape, var.dtype, var.device, var.kind))
            defined.add(name)
        block.ops.append(Op(op.name, op.type, op.args, dict(op.kwargs), list(op.outputs), dict(op.attrs)))
    names = {op.name for op in block.ops}
    sub.repoint_forward_ops({op.attrs["forward_op"]: None for op in block.ops
                             if op.attrs.get("forward_op") and op.attrs["forward_op"] not in names})
    sub.fetches = dict(fetches)
    return sub

"""Allreduce insertion: every gradient gets an averaging allreduce (role collective) right after its last producer.

Runs only in data-parallel Programs (`metadata["data_parallel"]`, stamped by fleet's trainer). The
producer's result is renamed `<param>@GRAD@LOCAL`; the allreduce's wait defines `<param>@GRAD`
again, so the optimizer ops and fetches read the averaged gradient without being touched. Under AMP (O1) the
gradient averaged is the float32 cast of a low-precision gradient (name_full_precision_gradients); under
use_pure_fp16 a low-precision parameter's gradient is averaged in its own dtype and cast after (low_precision.py).
Communicator groups the Program uses are listed in `metadata["collective_groups"]`. Under gradient
merge the accumulators are allreduced in its update block instead (allreduce_merged.py).
"""
from __future__ import annotations

from typing import Any

import torch

from fleetc.capture.to_program import rename_temporaries
from fleetc.comm.collectives import FLAT, HIERARCHICAL
from fleetc.comm.groups import group_partitions
from fleetc.errors import StrategyError
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ops.optimizer import MASTER_KEY
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import dead_op_names
from fleetc.passes.data_parallel.common import (
    ALLOC,
    AMP_CAST,
    GRAD_SUFFIX,
    LOCAL_SUFFIX,
    SINGLE_PROCESS,
    START,
    WAIT,
    common_module,
    is_backward,
    var_numel,
)
from fleetc.passes.data_parallel.low_precision import (
    average_in_low_precision,
    average_in_parameter_dtype,
)
from fleetc.passes.data_parallel.merged import (
    insert_update_block_allreduces,
    merged_values,
    note_moved,
)
from fleetc.passes.pipeline_parallel.stages import pipelined


def data_parallel_world(program: Program) -> int:
    """The data-parallel world size a Program was compiled for (1: not data parallel)."""
    return int(program.metadata.get("data_parallel", {}).get("world_size", 1))


def gradient_vars(program: Program) -> list[str]:
    """Gradient Vars (`<param>@GRAD` of a parameter) of the global block, in the order backward produces them."""
    block = program.global_block
    grads = []
    for op in block.ops:
        for name in op.defined:
            param = program.find_var(name.removesuffix(GRAD_SUFFIX)) if name.endswith(GRAD_SUFFIX) else None
            if param is not None and param.kind is VarKind.PARAM and block.vars[name].kind is VarKind.TEMP:
                grads.append(name)
    return grads


def name_full_precision_gradients(program: Program, grads: list[str]) -> None:
    """Under AMP (O1) a float32 parameter's gradient is computed in low precision and cast back: make the cast the
    gradient the ranks average, `<param>@GRAD`, and rename the low-precision one `<param>@GRAD@<dtype>`. Where
    the accumulators of a pipeline's micro-batches are what is averaged, the same holds under `use_pure_fp16` for
    the cast that feeds the float32 master weight's update (as Paddle accumulates master gradients in float32);
    plain data parallel averages those gradients in low precision instead (low_precision.py).

    Paddle and torch DDP sum a float32 parameter's gradient in float32; summing the bfloat16 one loses precision
    that only Paddle's `fp16_allreduce` opts into (low_precision.py's `average_in_low_precision`). Renaming (rather than averaging the cast under its own name)
    keeps every later pass's rule that the averaged gradient of `p` is `p@GRAD`."""
    block = program.global_block
    mapping: dict[str, str] = {}
    for grad in grads:
        param = grad.removesuffix(GRAD_SUFFIX)
        master = program.find_var(f"{param}@{MASTER_KEY}")  # use_pure_fp16: the update reads the float32 cast
        dtype = (master or program.var(param)).dtype
        if block.vars[grad].dtype == dtype:
            continue
        cast = next((op.outputs[0] for op in block.ops if op.type == AMP_CAST and op.args[0] == Ref(grad)
                     and block.vars[op.outputs[0]].dtype == dtype), None)
        if cast is not None:
            mapping[grad] = program.unique_name(f"{grad}@{block.vars[grad].dtype}")
            mapping[cast] = grad  # after the line above: rename_temporaries moves the Vars in this order
    rename_temporaries(program, mapping)
    for sub_block in program.blocks[1:]:  # e.g. AMP's skip-on-overflow update reads the cast
        for op in sub_block.ops:
            op.rename_inputs(mapping)


def allreduce_ops(program: Program, grads: list[str], comm: int, algorithm: str, label: str,
                   provenance: str) -> tuple[Op, Op, Op]:
    """The bucket's flat buffer, a start op copying `<g>@LOCAL` of `grads` into it and a wait op redefining each `<g>`.

    The buffer is a fresh `aten.empty` every step: the averaged gradients are views of it, and a user may hold
    them (`p.grad` without an optimizer) past the step. allreduce_views.py moves the allocation up so that
    producers write their gradients straight into it.
    """
    block = program.global_block
    first = block.vars[grads[0]]
    flat = block.add_var(Var(program.unique_name(f"{label}@FLAT"), (sum(var_numel(block.vars[g]) for g in grads),),
                             first.dtype, first.device))
    pending = block.add_var(Var(program.unique_name(f"{label}@WORK"), None, "work", first.device))
    attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": provenance,
             "module_path": common_module(program, grads)}
    alloc = Op(program.unique_name(f"{label}_buffer"), ALLOC, (list(flat.shape),),
               {"dtype": first.torch_dtype, "device": torch.device(first.device)}, [flat.name], dict(attrs))
    start = Op(program.unique_name(f"{label}_start"), START,
               (Ref(flat.name), [Ref(g + LOCAL_SUFFIX) for g in grads], [False] * len(grads), comm, algorithm, label),
               {}, [pending.name], dict(attrs))
    wait = Op(program.unique_name(f"{label}_wait"), WAIT,
              (Ref(flat.name), Ref(pending.name), [list(block.vars[g].shape) for g in grads]), {}, list(grads),
              dict(attrs))
    return alloc, start, wait


def algorithm_for(config: Any, world_size: int) -> str:
    """FLAT or HIERARCHICAL; a node size that does not divide the world is an error naming the field."""
    if not config.use_hierarchical_allreduce:
        return FLAT
    per_node = config.hierarchical_allreduce_inter_nranks
    if per_node < 2 or world_size % per_node or per_node == world_size:
        raise StrategyError(f"hierarchical_allreduce_inter_nranks={per_node} (ranks per node) must be at least 2, "
                            f"smaller than the world size {world_size} and divide it")
    return HIERARCHICAL


class InsertAllreduce:
    name = "insert_allreduce"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "average every gradient across data-parallel ranks, right after its last producer"
    reads = ("use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks", "nccl_comm_num", "fp16_allreduce")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        world = data_parallel_world(program)
        if world == 1:
            report.skipped_reason = SINGLE_PROCESS
            return program, report
        if "local_sgd" in program.metadata:
            report.skipped_reason = "local SGD: ranks update locally and average parameters instead (local_sgd)"
            return program, report
        if pipelined(program, config):
            report.skipped_reason = ("pipeline: each stage averages its gradients, summed over the micro-batches, "
                                     "across the data-parallel replicas in its optimizer Program (pipeline_split)")
            return program, report
        algorithm = algorithm_for(config, world)
        block = program.global_block
        merged = merged_values(program)  # gradient merge: its accumulators are allreduced instead, once per k steps
        if not merged:  # (under AMP the merged values already are the float32 casts)
            grads = gradient_vars(program)
            low = average_in_parameter_dtype(program, grads)  # use_pure_fp16: in the parameter's dtype
            name_full_precision_gradients(program, [g for g in grads if g not in low])
            if low:
                report.notes.append(f"use_pure_fp16: {len(low)} gradients averaged and kept in their parameters' "
                                    f"{program.var(low[0]).dtype}, as Paddle and torch DDP communicate them; the "
                                    "float32 master updates read the cast of the average")
            if config.fp16_allreduce:
                cast = average_in_low_precision(program, [g for g in grads if g not in low])
                report.count("fp16_allreduce_gradients", len(cast))
                report.notes.append(f"fp16_allreduce: {len(cast)} float32 gradients cast to {program.var(cast[0]).dtype} "
                                    "for the average and back to float32 after it" if cast else
                                    "fp16_allreduce: no float32 gradient to cast (every gradient is averaged in low "
                                    "precision already)")
        elif config.fp16_allreduce:
            report.notes.append("fp16_allreduce not applied: under gradient merge the float32 accumulators are "
                                "averaged once per k steps")
        grads = gradient_vars(program)
        production_index = {g: i for i, g in enumerate(grads)}
        per_step = {} if merged else production_index
        ops = []
        local_names: dict[str, str] = {}  # gradient → its rank-local value, for backward ops that read it
        dead = dead_op_names(program, block, set(program.fetches.values()))  # left to DCE, as they are
        for op in block.ops:
            if local_names and is_backward(op) and op.name not in dead:
                program.rename_reads(op, local_names)
            ops.append(op)
            produced = [g for g in op.defined if g in per_step]
            for grad in produced:
                local = block.add_var(Var(grad + LOCAL_SUFFIX, block.vars[grad].shape, block.vars[grad].dtype,
                                          block.vars[grad].device))
                op.outputs = [local.name if o == grad else o for o in op.outputs]
                local_names[grad] = local.name
            for grad in produced:
                comm = production_index[grad] % config.nccl_comm_num
                ops.extend(allreduce_ops(program, [grad], comm, algorithm, grad.removesuffix(GRAD_SUFFIX),
                                          self.name))
                report.count("allreduces")
        block.ops = ops
        if merged:
            insert_update_block_allreduces(program, [[g] for g in merged], config.nccl_comm_num, algorithm, self.name)
            report.count("allreduces", len(merged))
            note_moved(program, report, len(merged))
        program.metadata["collective_groups"] = group_partitions(
            world, config.nccl_comm_num, config.hierarchical_allreduce_inter_nranks, algorithm == HIERARCHICAL)
        report.changed = bool(grads)
        if not grads:
            report.skipped_reason = "the Program has no parameter gradients"
        return program, report

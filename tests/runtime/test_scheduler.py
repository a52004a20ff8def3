"""The multi-threaded scheduler: bitwise identical results for every num_threads, matching eager; errors from worker
threads; profiler ranges; the dependency graph's orderings; the other execution_strategy fields."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch
from conftest import run_side_by_side
from helpers.data_parallel import captured_program, run_data_parallel_passes
from helpers.gradient_merge import merge_strategy
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.errors import ExecutionError, StrategyError
from fleetc.ir.program import Program
from fleetc.runtime.dependencies import RNG, build_graph, draws_random
from fleetc.runtime.executor import Executable
from fleetc.runtime.scheduler import ScheduledStep


def threads_strategy(num_threads: int, strategy: fleetc.DistributedStrategy | None = None) -> fleetc.DistributedStrategy:
    strategy = strategy or fleetc.DistributedStrategy()
    strategy.execution_strategy.num_threads = num_threads
    return strategy




@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_every_thread_count_gives_the_same_bits_and_matches_eager(zoo_name):
    runs = {n: run_side_by_side(zoo_name, "adam", steps=3, strategy=threads_strategy(n)) for n in (1, 2, 4)}
    assert runs[1].trainer._last_train.executable.scheduled is None  # the straight-line default
    for n in (2, 4):
        scheduled = runs[n].trainer._last_train.executable.scheduled
        assert scheduled is not None and scheduled.num_threads == n
        runs[n].assert_same()
        runs[1].assert_compiled_identical(runs[n])


def test_gradient_merge_with_threads_gives_the_same_bits():
    runs = {n: run_side_by_side("gpt", "momentum", steps=4, strategy=threads_strategy(n, merge_strategy(2)))
            for n in (1, 4)}
    assert runs[4].trainer._last_train.executable.scheduled is not None
    runs[1].assert_compiled_identical(runs[4])


def test_fused_ops_keep_their_bits_with_threads():
    """gpt with fused dropout+add, gemm epilogues and auto-fused chains: 4 threads give the bits of one."""
    def fused(num_threads: int) -> fleetc.DistributedStrategy:
        strategy = threads_strategy(num_threads)
        build = strategy.build_strategy
        build.fuse_dropout_add = build.fuse_gemm_epilogue = build.fuse_elewise_add_act_ops = True
        build.enable_auto_fusion = True
        return strategy

    runs = {n: run_side_by_side("gpt", "sgd", steps=2, strategy=fused(n)) for n in (1, 4)}
    types = {op.type for op in runs[4].trainer.program.global_block.ops}
    assert types & {"fleetc.fused_dropout_add", "fleetc.fused_dropout_add_philox"}
    runs[4].assert_same()
    runs[1].assert_compiled_identical(runs[4])


def test_sequential_execution_runs_the_straight_line_function_whatever_num_threads():
    strategy = threads_strategy(4)
    strategy.build_strategy.enable_sequential_execution = True
    run = run_side_by_side("mlp", "sgd", steps=2, strategy=strategy)
    assert run.trainer._last_train.executable.scheduled is None
    report = run.trainer.report()
    assert any("program order on one thread" in line for line in report.execution)
    assert "build_strategy.enable_sequential_execution" not in report.skipped


def _mlp_executable(num_threads: int):
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, threads_strategy(num_threads), optimizer=OPTIMIZERS["sgd"](model.parameters()),
                             loss_fn=entry.loss_fn)
    args, _ = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args)
    compiled = trainer._last_train
    return compiled, list(args) + compiled.hyper_feeds.values()


@pytest.mark.parametrize("num_threads", [1, 4])
def test_an_error_in_a_worker_names_the_op_and_source_and_leaves_no_thread_running(num_threads):
    compiled, (x, y, *hyper) = _mlp_executable(num_threads)
    before = threading.active_count()
    with pytest.raises(ExecutionError) as info:
        compiled.executable.run(compiled.binding.resolve(), [x[:, :7], y, *hyper])  # wrong width: fc1's matmul fails
    message = str(info.value)
    assert "'addmm'" in message and "aten.addmm.default" in message and "module 'fc1'" in message
    assert "user source: " in message and "zoo.py:" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert threading.active_count() == before
    assert not [t for t in threading.enumerate() if t.name.startswith(("fleetc-worker-", "fleetc-comm"))]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_profiler_shows_each_op_under_its_module_path_and_name(num_threads):
    compiled, feeds = _mlp_executable(num_threads)
    program = compiled.program
    # torch records other threads than the one that started it only with profile_all_threads (docs/execution.md).
    all_threads = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=all_threads) as prof:
        compiled.executable.run(compiled.binding.resolve(), feeds)
    names = {event.name for event in prof.events()}
    for op in program.global_block.ops:
        label = f"{op.module_path}/{op.name}" if op.module_path else op.name
        assert label in names, label
    assert "fc1/addmm" in names


def test_random_draws_keep_program_order():
    program = captured_program("gpt")
    nodes = build_graph(program, program.global_block)
    drawing = [i for i, node in enumerate(nodes) if RNG in node.writes]
    assert len(drawing) >= 2 and all(draws_random(nodes[i].op.type) for i in drawing)
    for a, b in itertools.pairwise(drawing):
        assert b in nodes[a].successors


def test_independent_fused_dropouts_keep_program_order():
    """Two fused dropout+adds no data connects: each draws from the default generator inside a fleetc op, so the
    graph orders them anyway (else their masks could swap between runs)."""
    program = Program.parse("""
program: 3 ops, 1 block(s)
feeds: x: f32[4], y: f32[4]
fetches: out=z
block 0 {
  data x: f32[4] cpu
  data y: f32[4] cpu
  a: f32[4], ma: b8[4] = fleetc.fused_dropout_add(x, y, 0.5, True)  # forward
  b: f32[4], mb: b8[4] = fleetc.fused_dropout_add(y, x, 0.5, True)  # forward
  z: f32[4] = aten.add.Tensor(a, b)  # forward
}
""")
    nodes = build_graph(program, program.global_block)
    assert nodes[0].successors == [1, 2] and RNG in nodes[0].writes and RNG in nodes[1].writes


def test_collectives_form_one_chain_in_program_order():
    program, _ = run_data_parallel_passes(captured_program("mlp"))
    nodes = build_graph(program, program.global_block)
    comm = [i for i, node in enumerate(nodes) if node.collective]
    assert len(comm) >= 2
    for a, b in itertools.pairwise(comm):
        assert b in nodes[a].successors


def test_writing_through_a_view_waits_for_readers_of_its_base():
    program = Program.parse("""
program: 4 ops, 1 block(s)
feeds: x: f32[4]
fetches: out=z
block 0 {
  data x: f32[4] cpu
  v: f32[4] = aten.view.default(x, [4])  # forward
  y: f32[4] = aten.neg.default(x)  # forward
  w: f32[4] = aten.add_.Tensor(v, 1.0)  # forward
  z: f32[4] = aten.add.Tensor(y, w)  # forward
}
""")
    nodes = build_graph(program, program.global_block)
    assert 2 in nodes[1].successors  # add_ on the view of x waits for neg's read of x
    assert 2 in nodes[0].successors  # and for the view's definition
    x = torch.arange(4.0)
    out = Executable(program, num_threads=4).run({}, [x])
    assert torch.equal(out["out"], -torch.arange(4.0) + torch.arange(4.0) + 1)


def _trainer(strategy):
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    return model, fleetc.compile(model, strategy, optimizer=OPTIMIZERS["adam"](model.parameters()),
                                 loss_fn=entry.loss_fn)


def _mlp_batches(count: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [ZOO["mlp"].make_batch(g)[0] for _ in range(count)]


def test_num_iteration_per_run_trains_on_that_many_batches_per_call():
    batches = _mlp_batches(6)
    single_model, single = _trainer(None)
    single_losses = torch.stack([single.step(*batch) for batch in batches])
    strategy = fleetc.DistributedStrategy()
    strategy.execution_strategy.num_iteration_per_run = 3
    model, trainer = _trainer(strategy)
    losses = torch.cat([trainer.step(batches[:3]), trainer.step(iter(batches[3:]))])
    assert torch.equal(losses, single_losses)
    for name, value in single_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert "execution_strategy.num_iteration_per_run" not in trainer.report().skipped
    assert any("3 iteration(s) per step() call" in line for line in trainer.report().execution)
    with pytest.raises(StrategyError, match="num_iteration_per_run is 3: step\\(\\) takes one argument"):
        trainer.step(*batches[0])
    with pytest.raises(StrategyError, match="got only 2 batch"):
        trainer.step(batches[:2])


def test_execution_fields_are_reported_as_applied_and_thread_barrier_as_not_applicable():
    strategy = threads_strategy(2)
    strategy.execution_strategy.num_iteration_per_drop_scope = 2
    strategy.execution_strategy.use_thread_barrier = True
    _, trainer = _trainer(strategy)
    for batch in _mlp_batches(2):
        trainer.step(*batch)
    report = trainer.report()
    assert not [f for f in report.skipped if f.startswith("execution_strategy.") and "barrier" not in f]
    assert report.skipped["execution_strategy.use_thread_barrier"].startswith("not applicable: a parameter-server")
    assert any("2 compute threads" in line for line in report.execution)
    assert any("released every 2 iterations" in line for line in report.execution)
    assert "execution:" in str(report)
    assert trainer.execution.drop_scope(4) and not trainer.execution.drop_scope(3)


def test_a_fleetc_error_from_an_op_reaches_the_caller_as_it_is():
    program = Program.parse("""
program: 2 ops, 1 block(s)
feeds: x: f32[4]
fetches: out=z
block 0 {
  data x: f32[4] cpu
  y: f32[4] = aten.neg.default(x)  # forward
  z: f32[4] = aten.relu.default(y)  # forward
}
""")

    def collective_fails(*args):
        raise fleetc.CollectiveError("gradient allreduce 'b0' timed out waiting for rank 1")

    with pytest.raises(fleetc.CollectiveError, match="rank 1"):
        ScheduledStep(program, 2, {"z": collective_fails}).run({}, [torch.ones(4)])

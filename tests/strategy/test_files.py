"""Saving and loading strategies: prototxt (Paddle's layout), JSON, dicts, atomic writes, format choice."""

from __future__ import annotations

import os

import pytest

from fleetc.errors import StrategyError
from fleetc.passes.order import strategy_requests_without_pass
from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    atomic,
    load_strategy_file,
    resolve_strategy,
)
from fleetc.strategy.textformat import parse

from .fieldcases import FIELDS, PATHS, good_value, set_path


def everything_changed() -> DistributedStrategy:
    strategy = DistributedStrategy()
    for path in PATHS:
        set_path(strategy, path, good_value(FIELDS[path]))
    return strategy


def test_every_field_round_trips_through_prototxt(tmp_path):
    strategy = everything_changed()
    path = tmp_path / "all.prototxt"
    strategy.save_to_prototxt(path)
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(path)
    assert loaded == strategy
    assert loaded.to_dict() == strategy.to_dict()


def test_every_field_round_trips_through_dict_and_json():
    strategy = everything_changed()
    assert DistributedStrategy.from_dict(strategy.to_dict()) == strategy
    assert DistributedStrategy.from_json(strategy.to_json()) == strategy


def test_only_set_json_keeps_which_fields_were_set():
    strategy = DistributedStrategy()
    strategy.a_sync = True
    strategy.gradient_merge_configs = {"k_steps": 4}
    text = strategy.to_json(only_set=True)
    assert "fuse_all_reduce_ops" not in text
    loaded = DistributedStrategy.from_json(text)
    assert resolve_strategy(loaded).explicit_fields == {"a_sync", "gradient_merge_configs.k_steps"}


def test_prototxt_layout_matches_paddle(tmp_path):
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    strategy.recompute_configs = {"checkpoints": ["x", 'say "hi"\n']}
    strategy.pipeline_configs = {"schedule_mode": "FThenB"}
    strategy.build_strategy.fuse_bn_act_ops = True
    path = tmp_path / "s.prototxt"
    strategy.save_to_prototxt(path)
    assert path.read_text() == (
        'recompute_configs {\n  checkpoints: "x"\n  checkpoints: "say \\"hi\\"\\n"\n}\n'
        "gradient_merge: true\n"
        "gradient_merge_configs {\n  k_steps: 4\n  avg: true\n}\n"
        'pipeline_configs {\n  schedule_mode: "FThenB"\n}\n'
        "build_strategy {\n  fuse_bn_act_ops: true\n}\n"
    )


def test_fields_set_to_their_default_are_still_written(tmp_path):
    strategy = DistributedStrategy()
    strategy.execution_strategy.num_iteration_per_run = 1
    path = tmp_path / "s.prototxt"
    strategy.save_to_prototxt(path)
    assert path.read_text() == "execution_strategy {\n  num_iteration_per_run: 1\n}\n"


def test_collective_training_guide_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dist_strategy = DistributedStrategy()
    dist_strategy.sync_nccl_allreduce = True
    dist_strategy.nccl_comm_num = 2
    dist_strategy.fuse_all_reduce_ops = True
    build_strategy = BuildStrategy()
    build_strategy.enable_sequential_execution = True
    build_strategy.fuse_elewise_add_act_ops = True
    build_strategy.fuse_bn_act_ops = True
    build_strategy.enable_auto_fusion = True
    build_strategy.fuse_all_optimizer_ops = True
    dist_strategy.build_strategy = build_strategy
    execution_strategy = ExecutionStrategy()
    execution_strategy.num_threads = 3
    execution_strategy.num_iteration_per_drop_scope = 100
    execution_strategy.num_iteration_per_run = 1
    dist_strategy.execution_strategy = execution_strategy
    dist_strategy.amp = True
    dist_strategy.amp_configs = {
        "init_loss_scaling": 128, "decr_every_n_nan_or_inf": 2, "incr_every_n_steps": 1000, "incr_ratio": 2.0,
        "use_dynamic_loss_scaling": True, "decr_ratio": 0.5, "custom_white_list": [], "custom_black_list": [],
    }
    dist_strategy.save_to_prototxt("dist_strategy.prototxt")

    text = (tmp_path / "dist_strategy.prototxt").read_text()
    assert "nccl_comm_num: 2\n" in text
    assert "  init_loss_scaling: 128.0\n" in text
    assert "  num_iteration_per_run: 1\n" in text
    assert "fuse_bn_add_act_ops" not in text  # not set, still at its default
    loaded = DistributedStrategy()
    loaded.load_from_prototxt("dist_strategy.prototxt")
    assert loaded == dist_strategy
    assert loaded.build_strategy.enable_auto_fusion is True
    assert loaded.execution_strategy.num_iteration_per_drop_scope == 100
    assert loaded.amp_configs["decr_ratio"] == 0.5


PADDLE_STYLE = """\
# written by hand, Paddle style
amp: true
recompute: true
recompute_configs {
  checkpoints: "fc_0.tmp_0"
  checkpoints: "fc_1.tmp_0"
}
amp_configs {
  init_loss_scaling: 1024
  custom_white_list: "softmax"
  custom_black_list: ["tanh", "exp"]
  use_pure_fp16: false;
}
pipeline_configs < micro_batch: 4, schedule_mode: FThenB >
sharding_configs: { stage: 2 sharding_degree: 4 segment_broadcast_MB: 1e1 }
build_strategy {
  enable_sequential_execution: True
  fuse_all_optimizer_ops: t
}
execution_strategy { num_threads: 3 }
nccl_comm_num: 2
"""


def test_hand_written_paddle_prototxt_loads(tmp_path):
    path = tmp_path / "paddle.prototxt"
    path.write_text(PADDLE_STYLE)
    strategy = DistributedStrategy()
    strategy.load_from_prototxt(path)
    expected = DistributedStrategy()
    expected.amp = True
    expected.recompute = True
    expected.recompute_configs = {"checkpoints": ["fc_0.tmp_0", "fc_1.tmp_0"]}
    expected.amp_configs = {"init_loss_scaling": 1024.0, "custom_white_list": ["softmax"],
                            "custom_black_list": ["tanh", "exp"], "use_pure_fp16": False}
    expected.pipeline_configs = {"micro_batch_size": 4, "schedule_mode": "FThenB"}
    expected.sharding_configs = {"stage": 2, "sharding_degree": 4, "segment_broadcast_MB": 10.0}
    expected.build_strategy = {"enable_sequential_execution": True, "fuse_all_optimizer_ops": True}
    expected.execution_strategy.num_threads = 3
    expected.nccl_comm_num = 2
    assert strategy == expected


def test_load_merges_into_current_values(tmp_path):
    path = tmp_path / "part.prototxt"
    path.write_text('gradient_merge_configs { k_steps: 8 }\namp_configs { custom_white_list: "b" }\n')
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.gradient_merge_configs = {"avg": False}
    strategy.amp_configs = {"custom_white_list": ["a"], "incr_ratio": 4}
    strategy.load_from_prototxt(path)
    assert strategy.amp is True
    assert strategy.gradient_merge_configs == {"k_steps": 8, "avg": False}
    assert strategy.amp_configs["custom_white_list"] == ["b"]  # a repeated field in the file replaces the list
    assert strategy.amp_configs["incr_ratio"] == 4.0


@pytest.mark.parametrize(("text", "line", "message"), [
    ("amp: true\ngradient_merge_configs {\n  k_step: 4\n}\n", 3, "did you mean 'k_steps'"),
    ("amp: yes\n", 1, "true or false"),
    ("amp: true\nnccl_comm_num: 0\n", 2, ">= 1"),
    ("nccl_comm_num: 2.5\n", 1, "expects int"),
    ("gradient_merge_configs {\n  k_steps: 2\n", 3, "missing '}'"),
    ('amp: true\namp_configs { custom_white_list: "open }\n', 2, "unexpected character"),
    ("amp: true\n\namp: false\n", 3, "given twice"),
    ("amp_configs: 3\n", 1, "is a section"),
    ("amp { }\n", 1, "takes a value"),
    ("amp_configs { incr_ratio { } }\n", 1, "takes a value"),
    ('pipeline_configs {\n schedule_mode: "1f1b"\n}\n', 2, "did you mean '1F1B'"),
    ("amp_configs {\n custom_white_list: softmax\n}\n", 2, "expects a list of str, got the bare word softmax"),
    ('recompute_configs { checkpoints: "a\\q" }\n', 1, "invalid escape"),
    ("amp: true\n@\n", 2, "unexpected character '@'"),
    ("amp true\n", 1, "expected ':' or '{'"),
    ("amp: true\nfoo_bar: 1\n", 2, "unknown DistributedStrategy field 'foo_bar'"),
    ("amp:\n", 2, "expected a value"),
    ('recompute_configs { checkpoints: ["a" 3] }\n', 1, "expected ',' or ']'"),
])
def test_malformed_file_fails_with_line_and_changes_nothing(tmp_path, text, line, message):
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    strategy = DistributedStrategy()
    strategy.nccl_comm_num = 3
    before = strategy.to_dict()
    with pytest.raises(StrategyError) as info:
        strategy.load_from_prototxt(path)
    assert f"{path}:{line}:" in str(info.value)
    assert message in str(info.value)
    assert strategy.to_dict() == before


def test_text_format_strings_escapes_and_lists():
    entries = parse('a: "x\\ty" \'z\' b: ["\\101\\x42\\u00e9", "\\303\\251"] c: -1.5e2 d: 7 e: [] # done', "<t>")
    assert [(e.name, e.value) for e in entries] == [
        ("a", "x\tyz"), ("b", "ABé"), ("b", "é"), ("c", -150.0), ("d", 7)]
    assert isinstance(entries[-1].value, int)


def test_non_ascii_and_control_characters_round_trip(tmp_path):
    strategy = DistributedStrategy()
    names = ["编码器.层", "tab\there", "bell\a", "back\\slash"]
    strategy.recompute_configs = {"checkpoints": names}
    path = tmp_path / "u.prototxt"
    strategy.save_to_prototxt(path)
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(path)
    assert loaded.recompute_configs["checkpoints"] == names


def test_checkpoints_auto_round_trips(tmp_path):
    strategy = DistributedStrategy()
    strategy.recompute_configs = {"checkpoints": "auto", "memory_budget_mb": 512}
    path = tmp_path / "auto.prototxt"
    strategy.save_to_prototxt(path)
    assert 'checkpoints: "auto"' in path.read_text()
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(path)
    assert loaded.recompute_configs["checkpoints"] == "auto"
    assert loaded.recompute_configs["memory_budget_mb"] == 512.0


def _old_file(tmp_path):
    path = tmp_path / "s.prototxt"
    path.write_text("amp: true\n")
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    return path, strategy


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    path, strategy = _old_file(tmp_path)

    def failing_fsync(descriptor):
        raise OSError("disk gone")

    monkeypatch.setattr(atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk gone"):
        strategy.save_to_prototxt(path)
    assert path.read_text() == "amp: true\n"
    assert os.listdir(tmp_path) == ["s.prototxt"]


def test_write_failing_midway_leaves_old_file(tmp_path, monkeypatch):
    path, strategy = _old_file(tmp_path)
    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.write(text[: len(text) // 2])
            self.handle.flush()
            raise OSError("no space left")

    monkeypatch.setattr(atomic.os, "fdopen", lambda *args, **kwargs: HalfWriter(real_fdopen(*args, **kwargs)))
    with pytest.raises(OSError, match="no space left"):
        strategy.save_to_prototxt(path)
    assert path.read_text() == "amp: true\n"
    assert os.listdir(tmp_path) == ["s.prototxt"]


def test_failed_rename_leaves_old_file(tmp_path, monkeypatch):
    path, strategy = _old_file(tmp_path)

    def failing_replace(source, target):
        raise OSError("rename refused")

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename refused"):
        strategy.save_to_prototxt(path)
    assert path.read_text() == "amp: true\n"
    assert os.listdir(tmp_path) == ["s.prototxt"]


def test_successful_write_replaces_the_file(tmp_path):
    path, strategy = _old_file(tmp_path)
    strategy.save_to_prototxt(path)
    assert path.read_text() == "gradient_merge: true\n"
    assert os.listdir(tmp_path) == ["s.prototxt"]


@pytest.mark.parametrize(("name", "content"), [
    ("s.json", '{"gradient_merge": true, "gradient_merge_configs": {"k_steps": 4}}'),
    ("s.prototxt", "gradient_merge: true\ngradient_merge_configs { k_steps: 4 }\n"),
    ("strategy.cfg", '\n  {"gradient_merge": true, "gradient_merge_configs": {"k_steps": 4}}'),
    ("strategy.cfg", "# prototxt without the extension\ngradient_merge: true\n"
                     "gradient_merge_configs { k_steps: 4 }\n"),
])
def test_load_strategy_file_picks_the_format(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    strategy = load_strategy_file(path)
    assert strategy.gradient_merge is True
    assert strategy.gradient_merge_configs["k_steps"] == 4


@pytest.mark.parametrize(("content", "message"), [
    ('{"gradient_merge": true,\n "gradient_merge_configs": {"k_steps": 0}}', "k_steps must be >= 1"),
    ('{"gradient_merge": true,\n "gradient_merge_configs": {"k_steps": 4}', "invalid JSON at line 2"),
    ('{"gradient_merg": true}', "did you mean 'gradient_merge'"),
])
def test_bad_json_file_names_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(StrategyError) as info:
        load_strategy_file(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(("name", "content", "where", "message"), [
    ("bad.json", b'{"gradient_merge": true,\n "gradient_merge_configs": {"k_steps": 0}}', ":2:", "k_steps must be >= 1"),
    ("bad.json", b'{"amp": true,\n\n "amp": false}', ":3:", "key 'amp' is given twice"),
    ("bad.json", b'{"amp_configs": {"init_loss_scaling": NaN}}', ":1:", "must be a finite number"),
    ("bad.json", b'{\n"gradient_merg": true}', ":2:", "did you mean 'gradient_merge'"),
    ("bad.json", b"[" * 100_000 + b"]" * 100_000, ":", "nested too deeply"),
    ("bad.json", b'{"amp": true}\n\xff\xfe', ":2:", "not UTF-8"),
    ("bad.prototxt", b"amp: true\n\xc3\x28\n", ":2:", "not UTF-8"),
    ("bad.prototxt", b"a {" * 5000 + b"}" * 5000, ":1:", "nested more than 16 levels"),
    ("bad.prototxt", b"amp: true\x00\n", ":1:", "unexpected character"),
    ("bad.prototxt", b'\nrecompute_configs { checkpoints: "\\ud800" }\n', ":2:", "invalid unicode escape"),
    ("bad.prototxt", b'recompute_configs { checkpoints: "\\U00110000" }\n', ":1:", "invalid unicode escape"),
    ("bad.prototxt", b"amp_configs { init_loss_scaling: 1e999 }\n", ":1:", "finite number"),
    ("bad.prototxt", b"amp_configs < init_loss_scaling: 2 }\n", ":1:", "expected a field name"),
])
def test_hostile_files_are_strategy_errors_naming_file_and_line(tmp_path, name, content, where, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(StrategyError) as info:
        load_strategy_file(path)
    assert f"{path}{where}" in str(info.value) and message in str(info.value)
    if name.endswith(".prototxt"):
        with pytest.raises(StrategyError, match=message):
            DistributedStrategy().load_from_prototxt(path)


def test_a_missing_file_or_a_directory_is_a_strategy_error_naming_it(tmp_path):
    for path in (tmp_path / "missing.prototxt", tmp_path):
        with pytest.raises(StrategyError, match=f"{path}: cannot read the strategy file"):
            load_strategy_file(path)


PADDLE_WRITTEN = """mode: COLLECTIVE
amp: true
dgc: false
fp16_allreduce: true
without_graph_optimization: true
amp_configs {
  init_loss_scaling: 32768.0
  use_pure_fp16: false
  use_fp16_guard: true
  use_pure_bf16: false
}
dgc_configs {
  rampup_begin_step: 0
  rampup_step: 1
  sparsity: 0.999
}
sharding_configs {
  sharding_segment_strategy: "segment_broadcast_MB"
  mp_degree: 2
}
build_strategy {
  enable_addto: true
  memory_optimize: false
  fuse_resunit: false
}
tensor_parallel: false
tensor_parallel_configs { tensor_parallel_degree: 1 tensor_init_seed: -1 }
qat: false
heter_ccl_mode: false
semi_auto: false
asp: false
gradient_scale_configs { scale_strategy: "avg" scale_gradient: false }
"""


def test_a_prototxt_with_paddle_only_fields_loads_and_they_are_reported_as_not_applied(tmp_path):
    path = tmp_path / "paddle.prototxt"
    path.write_text(PADDLE_WRITTEN)
    strategy = load_strategy_file(path)
    assert strategy.mode == "COLLECTIVE" and strategy.fp16_allreduce is True
    assert strategy.dgc_configs["sparsity"] == [0.999] and strategy.build_strategy.enable_addto is True
    skipped = strategy_requests_without_pass(resolve_strategy(strategy))
    assert set(skipped) == {"sharding_configs.mp_degree", "build_strategy.enable_addto", "dgc_configs.sparsity"}
    assert all(why.startswith("not applied: a Paddle setting") for why in skipped.values())
    path.write_text("fp16_allreduc: true\n")
    with pytest.raises(StrategyError, match=r":1: .*did you mean 'fp16_allreduce'"):
        load_strategy_file(path)


PADDLE_MESSAGES = """\
qat_configs { algo: "abs_max" }
a_sync_configs { heter_worker_device_guard: "gpu" }
build_strategy { debug_graphviz_path: "/tmp/graphs" }
hybrid_configs {
  mp_configs { sync_param: true sync_mode: "broadcast" sync_param_name: "fc" sync_param_name: "emb" }
  pp_configs { dp_comm_overlap: false }
}
recompute_configs {
  refined_ops_patterns { main_ops: "matmul" num: 2 pre_ops: "softmax" }
  refined_ops_patterns { main_ops: "dropout" num: -1 }
}
trainer_desc_configs { dump_fields_path: "__import__('os').system('touch pwned')" dump_fields: "a" dump_fields: "b" }
downpour_table_param {
  table_id: 0
  accessor { accessor_class: "CtrCommonAccessor" sgd_param { name: "SparseAdaGradSGDRule" adagrad { rate: 0.05 } } }
}
fs_client_param { uri: "hdfs://x" user: "u" passwd: "p" hadoop_bin: "/bin/hadoop" }
"""


def test_paddle_free_text_and_nested_messages_load_round_trip_and_are_reported(tmp_path):
    """Regression: a Paddle prototxt with free-text fields or nested / parameter-server messages was refused. They
    load as plain data (the restricted parser evaluates nothing), save back to the same values, survive JSON, and
    report() says they are not applied."""
    path = tmp_path / "paddle.prototxt"
    path.write_text(PADDLE_MESSAGES)
    strategy = load_strategy_file(path)
    assert strategy.hybrid_configs["mp_configs"] == {"sync_param": True, "sync_mode": "broadcast",
                                                     "sync_param_name": ["fc", "emb"]}
    assert strategy.recompute_configs["refined_ops_patterns"][1] == {"main_ops": "dropout", "num": -1}
    assert strategy.downpour_table_param[0]["accessor"]["sgd_param"]["adagrad"] == {"rate": 0.05}
    assert strategy.trainer_desc_configs["dump_fields_path"].startswith("__import__")
    strategy.save_to_prototxt(tmp_path / "again.prototxt")
    assert load_strategy_file(tmp_path / "again.prototxt").to_dict() == strategy.to_dict()
    assert DistributedStrategy.from_json(strategy.to_json()).to_dict() == strategy.to_dict()
    skipped = strategy_requests_without_pass(resolve_strategy(strategy))
    assert set(skipped) == {"qat_configs.algo", "a_sync_configs.heter_worker_device_guard",
                            "build_strategy.debug_graphviz_path", "hybrid_configs.mp_configs",
                            "hybrid_configs.pp_configs", "recompute_configs.refined_ops_patterns",
                            "trainer_desc_configs", "downpour_table_param", "fs_client_param"}
    assert all(why.startswith("not applied: a Paddle setting") for why in skipped.values())


@pytest.mark.parametrize(("text", "match"), [
    ('fs_client_param: "hdfs://x"\n', r":1: fs_client_param is a message; write 'fs_client_param \{ ... \}'"),
    ("hybrid_configs {\n  mp_configs: 3\n}\n", r":2: hybrid_configs.mp_configs is a message"),
    ("downpour_table_param { accessor { rate: nan } }\n", r":1: downpour_table_param.accessor.rate must be a finite"),
    ("hybrid_configs { mp_config { sync_param: true } }\n", r":1: .*did you mean 'mp_configs'"),
])
def test_bad_paddle_messages_are_strategy_errors_naming_file_and_line(tmp_path, text, match):
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    with pytest.raises(StrategyError, match=str(path).replace(".", r"\.") + match):
        load_strategy_file(path)

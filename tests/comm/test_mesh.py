"""The process mesh: rank order, groups along each axis, and how degrees are read from the strategy."""
from __future__ import annotations

import pytest

import fleetc
from fleetc.comm.mesh import ProcessMesh, pipeline_layout, resolve_mesh
from fleetc.strategy import resolve_strategy


def config(**fields):
    strategy = fleetc.DistributedStrategy()
    for name, value in fields.items():
        setattr(strategy, name, value)
    return resolve_strategy(strategy)


def test_ranks_count_in_axis_order_with_the_innermost_fastest():
    mesh = ProcessMesh(dp=2, pp=2, sharding=2)
    assert [mesh.coordinates(r) for r in (0, 1, 2, 5)] == [
        {"dp": 0, "pp": 0, "sharding": 0, "mp": 0}, {"dp": 0, "pp": 0, "sharding": 1, "mp": 0},
        {"dp": 0, "pp": 1, "sharding": 0, "mp": 0}, {"dp": 1, "pp": 0, "sharding": 1, "mp": 0}]
    assert all(mesh.rank(**mesh.coordinates(r)) == r for r in range(mesh.world_size))


def test_groups_partition_the_world_along_one_axis():
    mesh = ProcessMesh(dp=2, pp=2)
    assert mesh.groups("pp") == [[0, 1], [2, 3]]
    assert mesh.groups("dp") == [[0, 2], [1, 3]]
    assert mesh.groups("sharding") == [[0], [1], [2], [3]]
    assert mesh.group_of("dp", 3) == [1, 3]
    for axis in ("dp", "pp", "sharding", "mp"):
        assert sorted(r for group in mesh.groups(axis) for r in group) == list(range(4))


def test_groups_along_several_axes_are_the_ranks_of_one_pipeline_stage():
    mesh = ProcessMesh(dp=2, pp=2, sharding=2)
    assert mesh.groups("dp", "sharding") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # the replicas of stage 0, of stage 1
    assert mesh.groups("sharding") == [[0, 1], [2, 3], [4, 5], [6, 7]]   # each stage's sharding groups
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]          # the pipelines
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        mesh.groups("dp", "tp")


def test_plain_data_parallel_is_all_dp():
    mesh, notes = resolve_mesh(config(), 4)
    assert mesh == ProcessMesh(dp=4) and notes == ["hybrid_configs.dp_degree is -1: 4 data-parallel replicas "
                                                   "(the world size left over)"]


def test_stages_come_from_annotations_or_pp_degree_and_must_agree():
    assert resolve_mesh(config(pipeline=True), 4, stages=2)[0] == ProcessMesh(dp=2, pp=2)
    assert resolve_mesh(config(pipeline=True, hybrid_configs={"pp_degree": 4}), 4)[0] == ProcessMesh(pp=4)
    with pytest.raises(fleetc.StrategyError, match="pp_degree is 4 but the model's device_guard marks 2"):
        resolve_mesh(config(pipeline=True, hybrid_configs={"pp_degree": 4}), 4, stages=2)
    with pytest.raises(fleetc.StrategyError, match="strategy.pipeline is off"):
        resolve_mesh(config(hybrid_configs={"pp_degree": 2}), 4)


def test_sharding_degree_default_means_the_rest_of_the_world_and_says_so():
    mesh, notes = resolve_mesh(config(sharding=True), 4)
    assert mesh == ProcessMesh(sharding=4)
    assert any("sharding_degree is not set" in note for note in notes)
    mesh, _ = resolve_mesh(config(sharding=True, sharding_configs={"sharding_degree": 8}), 8)
    assert mesh == ProcessMesh(sharding=8)  # set explicitly: taken literally
    mesh, _ = resolve_mesh(config(sharding=True, sharding_configs={"sharding_degree": 2}), 4)
    assert mesh == ProcessMesh(dp=2, sharding=2)
    mesh, _ = resolve_mesh(config(sharding=True, pipeline=True), 4, stages=2)
    assert mesh == ProcessMesh(pp=2, sharding=2)


@pytest.mark.parametrize(("fields", "world", "field"), [
    ({"sharding": True, "sharding_configs": {"sharding_degree": 3}}, 4, "sharding_configs.sharding_degree"),
    ({"hybrid_configs": {"dp_degree": 3}}, 4, "hybrid_configs.dp_degree"),
    ({"pipeline": True, "hybrid_configs": {"pp_degree": 3}}, 4, "hybrid_configs.pp_degree"),
    ({"hybrid_configs": {"dp_degree": 2}}, 4, "must equal the world size"),
])
def test_degrees_that_do_not_fit_the_world_name_the_field(fields, world, field):
    with pytest.raises(fleetc.StrategyError, match=field.replace(".", r"\.")):
        resolve_mesh(config(**fields), world)


@pytest.mark.parametrize("degree", [3, 4])
def test_a_sharding_degree_that_does_not_fit_a_pipeline_stage_names_the_field(degree):
    with pytest.raises(fleetc.StrategyError, match=rf"sharding_configs\.sharding_degree is {degree}, which does not "
                                                   r"divide the 2 ranks of each pipeline stage \(world size 4 / 2"):
        resolve_mesh(config(sharding=True, pipeline=True, sharding_configs={"sharding_degree": degree}), 4, stages=2)


def test_tensor_parallel_is_refused_by_name():
    with pytest.raises(fleetc.StrategyError, match="mp_degree is 2: tensor .model. parallelism is not implemented"):
        resolve_mesh(config(hybrid_configs={"mp_degree": 2}), 2)


def test_the_pipeline_layout_comes_from_the_strategy_before_a_capture():
    """(pipeline ranks, chunks per rank, k_steps): the depth from hybrid_configs.pp_degree (chunks over vpp_degree),
    or from the captured device_guard stage count; unknown (None) before that capture without pp_degree."""
    merge = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 3}}
    assert pipeline_layout(config(pipeline=True, hybrid_configs={"pp_degree": 4}, **merge), None) == (4, 1, 3)
    vpp = config(pipeline=True, pipeline_configs={"vpp_degree": 2, "schedule_mode": "VPP"})
    assert pipeline_layout(vpp, None) == (None, 2, 1)
    assert pipeline_layout(vpp, 8) == (4, 2, 1)
    assert pipeline_layout(config(pipeline=True, **merge), 2) == (2, 1, 3)
    assert pipeline_layout(config(**merge), 4) is None  # no pipeline
    with pytest.raises(fleetc.StrategyError, match="pp_degree is 4 but the model's device_guard marks 2"):
        pipeline_layout(config(pipeline=True, hybrid_configs={"pp_degree": 4}), 2)

"""str, repr and HTML of strategies: what differs from the defaults, grouped by section."""

from __future__ import annotations

from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    Strategy,
    resolve_strategy,
)


def sample() -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    strategy.amp_configs = {"custom_white_list": ["matmul"], "init_loss_scaling": 128}
    strategy.build_strategy.fuse_bn_act_ops = True
    strategy.nccl_comm_num = 2
    return strategy


def test_str_lists_changed_fields_by_section():
    assert str(sample()) == (
        "DistributedStrategy (7 fields differ from defaults)\n"
        "  gradient_merge = True  (default False)\n"
        "  gradient_merge_configs:\n"
        "    k_steps = 4  (default 1)\n"
        "  amp = True  (default False)\n"
        "  amp_configs:\n"
        "    init_loss_scaling = 128.0  (default 32768.0)\n"
        "    custom_white_list = ['matmul']  (default [])\n"
        "  nccl_comm_num = 2  (default 1)\n"
        "  build_strategy:\n"
        "    fuse_bn_act_ops = True  (default False)"
    )


def test_str_of_defaults_says_so():
    assert str(DistributedStrategy()) == "DistributedStrategy (all fields at their defaults)"
    assert str(BuildStrategy()) == "BuildStrategy (all fields at their defaults)"


def test_repr_is_short_switches_first():
    assert repr(sample()) == "DistributedStrategy(gradient_merge=True, amp=True, nccl_comm_num=2, +4 fields)"
    assert repr(DistributedStrategy()) == "DistributedStrategy()"
    build = BuildStrategy()
    build.fuse_bn_act_ops = True
    assert repr(build) == "BuildStrategy(fuse_bn_act_ops=True)"


def test_html_table_has_field_value_default_rows():
    page = sample()._repr_html_()
    assert page.startswith("<table>") and page.endswith("</table>")
    assert "<th>field</th><th>value</th><th>default</th>" in page
    assert "<tr><td><code>amp_configs.custom_white_list</code></td><td>[&#x27;matmul&#x27;]</td>" \
           "<td>[]</td></tr>" in page
    assert page.count("<tr><td>") == 7


def test_new_style_and_config_display():
    strategy = Strategy({"sharding": {"enable": True, "stage": 2}})
    assert repr(strategy) == "Strategy(sharding.enable=True, sharding.stage=2)"
    assert "  sharding:\n    enable = True  (default False)\n    stage = 2  (default 1)" in str(strategy)
    cfg = resolve_strategy(strategy)
    assert repr(cfg) == "StrategyConfig(sharding=True, sharding_configs.stage=2)"
    assert "sharding_configs.stage" in cfg._repr_html_()

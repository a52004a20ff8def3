"""`lars` and `lamb`: the optimizer update replaced by its layer-wise adaptive form, as Paddle's meta-optimizers do.

LARS replaces Momentum (torch.optim.SGD with momentum != 0: `fleetc.sgd` with a momentum buffer) by
`fleetc.lars_momentum`; LAMB replaces Adam (`fleetc.adam` without decoupled decay; Paddle's AdamW is
not an Adam, so neither is torch's) by `fleetc.lamb`. Both keep the update's fed lr, momentum / betas
and eps, and take lars_coeff, the weight decay and epsilon from the strategy; a parameter whose name
contains one of `exclude_from_weight_decay`'s strings gets no weight decay (and, as in Paddle, no
layer-wise rate: see fleetc/ops/layerwise.py). LARS keeps its velocity in
`optimizer.state[p]["lars_velocity"]` (it includes the learning rate, unlike SGD's momentum buffer);
LAMB keeps Adam's `exp_avg`, `exp_avg_sq` and `step`. Running before AMP, the new ops then update
float32 master weights (`use_pure_fp16`), move into gradient merge's update block, read allreduced
gradients and are fused by `fuse_all_optimizer_ops` like the updates they replace.
"""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Block, Op, OpRole, Program, Ref
from fleetc.passes.base import PassReport


def drop_unread_feeds(program: Program) -> list[str]:
    """Remove the optimizer's HYPER feeds no op reads any more (a replaced update's momentum-fresh flag)."""
    read = {name for _, op in program.walk_ops() for name in op.inputs}
    meta = program.metadata.get("optimizer", {})
    unread = [spec["var"] for spec in meta.get("feeds", ()) if spec["var"] not in read]
    for name in unread:
        program.feeds.remove(name)
        del program.global_block.vars[name]
    meta["feeds"] = [spec for spec in meta.get("feeds", ()) if spec["var"] not in unread]
    return unread


class _LayerwiseRewrite:
    """Shared by Lars and Lamb: find the updates the strategy replaces, rewrite each, report what happened."""

    name = ""
    replaces = ""  # what Paddle's meta-optimizer requires of the inner optimizer, in words

    def accepts(self, op: Op) -> bool:
        raise NotImplementedError

    def rewrite(self, program: Program, block: Block, op: Op, weight_decay: float, cfg: Any) -> Op:
        raise NotImplementedError

    def weight_decay(self, cfg: Any) -> float:
        raise NotImplementedError

    def dropped(self, op: Op) -> str | None:
        """Which of the replaced update's settings the new one ignores (None: nothing is lost)."""
        raise NotImplementedError

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        cfg = getattr(config, f"{self.name}_configs")
        report = PassReport(self.name)
        updates = [(block, op) for block, op in program.walk_ops() if OpRole.OPTIMIZE in op.role and "param" in op.attrs]
        accepted = [(block, op) for block, op in updates if self.accepts(op)]
        if not accepted:
            found = sorted({op.type for _, op in updates}) or ["no optimizer update"]
            report.skipped_reason = (f"{self.name} replaces {self.replaces}, as in Paddle; this Program's updates "
                                     f"are {', '.join(found)}")
            return program, report
        patterns = tuple(cfg.exclude_from_weight_decay)
        matched: set[str] = set()
        excluded = []
        dropped = {self.dropped(op) for _, op in accepted} - {None}
        for block, op in accepted:
            param = op.attrs["param"]
            hits = {p for p in patterns if p in param}
            matched |= hits
            if hits:
                excluded.append(param)
            new = self.rewrite(program, block, op, 0.0 if hits else self.weight_decay(cfg), cfg)
            block.ops[block.ops.index(op)] = new
            program.repoint_forward_ops({op.name: new.name})
        drop_unread_feeds(program)
        report.changed = True
        report.count("updates_replaced", len(accepted))
        report.count("excluded_from_weight_decay", len(excluded))
        others = len({op.attrs["param"] for _, op in updates}) - len(accepted)
        if others:
            report.notes.append(f"{others} parameter update(s) are not {self.replaces} and stay as they are")
        report.notes += sorted(dropped)
        if excluded:
            report.notes.append(f"no weight decay and no layer-wise adaptation for {excluded}")
        for pattern in sorted(set(patterns) - matched):
            report.notes.append(f"{self.name}_configs.exclude_from_weight_decay: {pattern!r} is in no parameter name")
        return program, report


class Lars(_LayerwiseRewrite):
    name = "lars"
    enabled_by = "lars"
    summary = "Momentum updates → LARS momentum (layer-wise rate lr * lars_coeff * |p| / (|g| + wd * |p| + eps))"
    reads = ("lars", "lars_configs")
    replaces = "Momentum (torch.optim.SGD with momentum != 0)"

    def accepts(self, op: Op) -> bool:
        return op.type == "fleetc.sgd" and op.args[2] is not None

    def weight_decay(self, cfg: Any) -> float:
        return float(cfg.lars_weight_decay)

    def dropped(self, op: Op) -> str | None:
        nesterov, dampening = op.args[7], op.args[6]
        if nesterov or dampening != 0.0:
            return "SGD's nesterov and dampening do not apply: Paddle's LARS momentum has neither"
        return None

    def rewrite(self, program: Program, block: Block, op: Op, weight_decay: float, cfg: Any) -> Op:
        param, grad, buffer, _fresh, lr, momentum, _dampening, _nesterov, sgd_decay, maximize = op.args
        velocity = f"{op.attrs['param']}@lars_velocity"
        var = program.global_block.vars.pop(buffer.name)
        var.name = velocity
        program.global_block.add_var(var)
        bindings = program.metadata["state_bindings"]
        bindings[velocity] = [bindings.pop(buffer.name)[0], "lars_velocity"]
        return Op(op.name.replace(".sgd", ".lars_momentum"), "fleetc.lars_momentum",
                  (param, grad, Ref(velocity), weight_decay, lr, momentum, sgd_decay, maximize,
                   float(cfg.lars_coeff), float(cfg.epsilon)),
                  outputs=[param.name, velocity], attrs={**op.attrs, "provenance": self.name})


class Lamb(_LayerwiseRewrite):
    name = "lamb"
    enabled_by = "lamb"
    summary = "Adam updates → LAMB (trust ratio |p| / |r| on the Adam step r plus weight decay)"
    reads = ("lamb", "lamb_configs")
    replaces = "Adam (torch.optim.Adam, amsgrad off)"

    def accepts(self, op: Op) -> bool:
        return op.type == "fleetc.adam" and op.args[10] is False

    def weight_decay(self, cfg: Any) -> float:
        return float(cfg.lamb_weight_decay)

    def dropped(self, op: Op) -> str | None:
        if op.args[9] != 0.0:
            return "Adam's weight_decay does not apply: Paddle's LAMB decays by lamb_weight_decay only"
        return None

    def rewrite(self, program: Program, block: Block, op: Op, weight_decay: float, cfg: Any) -> Op:
        param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, _adam_decay, _decoupled, maximize = op.args
        return Op(op.name.rsplit(".", 1)[0] + ".lamb", "fleetc.lamb",
                  (param, grad, exp_avg, exp_avg_sq, step, weight_decay, lr, beta1, beta2, eps, maximize),
                  outputs=list(op.outputs), attrs={**op.attrs, "provenance": self.name})

"""Export test helpers: trained zoo trainers, eval inputs, and exported models run in a process without fleetc."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import torch

import fleetc

# Runs in a fresh interpreter where `import fleetc` fails: what it loads must need nothing but torch.
_LOADER = """
import sys
sys.modules["fleetc"] = None  # any import of fleetc now raises ImportError
import torch
inputs_file, outputs_file = sys.argv[1], sys.argv[2]
runs = torch.load(inputs_file, weights_only=True)
outputs = []
for path, args in runs:
    outputs.append(torch.export.load(path).module()(*args))
loaded = sorted(name for name, module in sys.modules.items() if name.startswith("fleetc") and module is not None)
assert not loaded, f"fleetc modules were imported: {loaded}"
torch.save(outputs, outputs_file)
"""


def fusion_strategy() -> fleetc.DistributedStrategy:
    """Every fusion pass that rewrites eval Programs, so that export lowers each kind of fused op."""
    strategy = fleetc.DistributedStrategy()
    build = strategy.build_strategy
    build.fuse_bn_act_ops = build.fuse_elewise_add_act_ops = build.fuse_gemm_epilogue = True
    build.enable_auto_fusion = True
    return strategy


def trained(entry: Any, strategy: Any = None, steps: int = 2) -> tuple[fleetc.CompiledTrainer, tuple, dict]:
    """A zoo entry's model trained `steps` SGD steps by fleetc; and one batch's eval inputs (args, kwargs)."""
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                             loss_fn=entry.loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        args, kwargs = entry.make_batch(g)
        trainer.step(*args, **kwargs)
    args, kwargs = entry.make_batch(g)
    if entry.loss_fn is not None:
        args = args[:-1]
    return trainer, args, {k: v for k, v in kwargs.items() if k != "labels"}


def eager_eval(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model.eval()(*args, **kwargs)` without gradients, leaving the model's mode as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    finally:
        model.train(was_training)


def run_without_fleetc(runs: list[tuple[pathlib.Path, tuple]], work: pathlib.Path) -> list[Any]:
    """Each (.pt2 file, positional inputs) loaded with torch.export.load and called, in one fresh process that
    cannot import fleetc; returns the outputs in order."""
    inputs, outputs = work / "inputs.pt", work / "outputs.pt"
    torch.save([(str(path), tuple(args)) for path, args in runs], inputs)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", _LOADER, str(inputs), str(outputs)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(outputs, weights_only=True)


def aten_call_count(exported: torch.export.ExportedProgram) -> int:
    """Operator calls in an exported graph (getitem nodes that unpack results do not count)."""
    return sum(1 for node in exported.graph.nodes
               if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload))


def op_types(exported: torch.export.ExportedProgram) -> set[str]:
    return {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}

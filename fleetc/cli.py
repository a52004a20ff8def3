"""The `fleetc` command line: `dump-ir` prints a model's Program after any compiler pass, `export` saves it for
inference, `run` launches data-parallel training."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fleetc
from fleetc.codegen.cpu import format_kernels as format_cpu_kernels
from fleetc.codegen.triton import format_kernels
from fleetc.errors import CommandError, ExportError, FleetcError
from fleetc.fleet import export_sources, inference
from fleetc.fleet.explain import add_explain_command
from fleetc.fleet.launch import add_run_command
from fleetc.fleet.sharding_estimate import (
    format_plans,
    measure_ranks,
    plan_for_world,
    representative_ranks,
)
from fleetc.fleet.trainer import DataParallelTrainer
from fleetc.ir.liveness import MemoryEstimate
from fleetc.ir.serialize import program_to_json, to_dict
from fleetc.passes.manager import History, PassRecord
from fleetc.passes.order import all_pass_names
from fleetc.passes.pipeline_parallel.split import format_pipeline
from fleetc.passes.sharding.estimate import RankPlan
from fleetc.strategy import load_strategy_file
from fleetc.strategy.atomic import write_atomically
from fleetc.strategy.names import closest
from fleetc.viz.dump_files import write_pass_files
from fleetc.viz.report import report_html

FACTORY_KEYS = ("model", "args", "kwargs", "loss_fn", "optimizer", "strategy")

_DUMP_IR_DESCRIPTION = """\
Compile a model's training step and print its Program after a compiler pass.

FACTORY is `package.module:function` (imported with the current directory on sys.path): a
zero-argument callable returning a dict with
  model      the nn.Module (required)
  args       example positional arguments of one step, a tuple or list (required)
  kwargs     example keyword arguments (optional)
  loss_fn    loss_fn(output, args[-1]); leave it out when the model returns its loss
  optimizer  a torch.optim optimizer; when the key is absent, SGD(lr=0.01) is used so the
             optimize section shows; None compiles without an optimizer
  strategy   any fleetc strategy object (optional; --strategy overrides it)

dump-ir runs one real training step on the factory's objects: the model's parameters and the
optimizer's state are updated once.
"""


@dataclass
class StepSpec:
    """What a factory returned: the objects to compile and the example inputs of one step."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    optimizer: torch.optim.Optimizer | None
    strategy: Any


def _hint(name: str, candidates: Sequence[str]) -> str:
    match = closest(name, candidates)
    return f"; did you mean {match!r}?" if match else ""


def _import_factory(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CommandError(f"factory {spec!r} must look like 'package.module:function'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a model file beside the user is found
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import module {module_name!r}: {exc}") from None
    except SyntaxError as exc:
        raise CommandError(f"cannot import module {module_name!r}: syntax error at {exc.filename}:{exc.lineno}: "
                           f"{exc.msg}") from None
    except Exception as exc:  # the module's own code failed while importing: report it, do not crash
        raise CommandError(f"importing module {module_name!r} raised {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            public = [n for n in dir(target) if not n.startswith("_")]
            raise CommandError(f"{module_name!r} has no attribute {attr!r}{_hint(part, public)}")
        target = getattr(target, part)
    if not callable(target):
        raise CommandError(f"{spec!r} is not a callable factory (it is a {type(target).__name__})")
    try:
        inspect.signature(target).bind()
    except TypeError as exc:
        raise CommandError(f"factory {spec!r} must take no arguments ({exc})") from None
    except ValueError:
        pass  # no signature to check (a builtin): calling it will tell
    return target


def _call_factory(factory: Callable, spec: str) -> Any:
    try:
        return factory()
    except FleetcError:
        raise
    except Exception as exc:  # the user's factory failed: one line naming it, not a traceback
        raise CommandError(f"factory {spec!r} raised {type(exc).__name__}: {exc}") from None


def _step_spec(result: Any, spec: str) -> StepSpec:
    if not isinstance(result, Mapping):
        raise CommandError(f"factory {spec!r} returned {type(result).__name__}; "
                           "expected a dict with 'model' and 'args'")
    unknown = [k for k in result if k not in FACTORY_KEYS]
    if unknown:
        key = str(unknown[0])
        raise CommandError(f"factory {spec!r} returned unknown key {key!r}{_hint(key, FACTORY_KEYS)} "
                           f"(keys: {', '.join(FACTORY_KEYS)})")
    missing = [k for k in ("model", "args") if k not in result]
    if missing:
        raise CommandError(f"factory {spec!r} returned no {' or '.join(map(repr, missing))}")
    model, args, kwargs = result["model"], result["args"], result.get("kwargs") or {}
    if not isinstance(model, nn.Module):
        raise CommandError(f"factory {spec!r}: 'model' is a {type(model).__name__}, not an nn.Module")
    if not isinstance(args, (tuple, list)):
        raise CommandError(f"factory {spec!r}: 'args' is a {type(args).__name__}, not a tuple or list")
    if not isinstance(kwargs, Mapping):
        raise CommandError(f"factory {spec!r}: 'kwargs' is a {type(kwargs).__name__}, not a dict")
    optimizer = result["optimizer"] if "optimizer" in result else torch.optim.SGD(model.parameters(), lr=0.01)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CommandError(f"factory {spec!r}: 'optimizer' is a {type(optimizer).__name__} ({optimizer!r:.40}), not a "
                           "torch.optim.Optimizer: build it, e.g. torch.optim.SGD(model.parameters(), lr=0.01)")
    if result.get("loss_fn") is not None and not callable(result["loss_fn"]):
        raise CommandError(f"factory {spec!r}: 'loss_fn' is a {type(result['loss_fn']).__name__}, not a callable")
    return StepSpec(model, tuple(args), dict(kwargs), result.get("loss_fn"), optimizer, result.get("strategy"))


def _load_strategy(path: str) -> Any:
    try:
        return load_strategy_file(path)
    except (OSError, UnicodeDecodeError, FleetcError) as exc:
        raise CommandError(f"cannot load strategy file {path!r}: {exc}") from None


def _check_options(options: argparse.Namespace) -> None:
    """Misspelt pass names and option clashes fail before the (slow) compile."""
    passes = all_pass_names()
    for name in options.disable_pass:
        if name not in passes:
            raise CommandError(f"unknown pass {name!r} for --disable-pass{_hint(name, passes)} "
                               f"(passes: {', '.join(passes)})")
    stages = ["capture", *passes]
    if options.after not in (None, "all", *stages):
        raise CommandError(f"unknown pass {options.after!r} for --after{_hint(options.after, [*stages, 'all'])} "
                           f"(passes: {', '.join(stages)}, or all)")
    if options.memory and options.format != "text":
        raise CommandError("--memory applies to --format text only")
    if options.dir is not None and (options.out is not None or options.format == "html"):
        raise CommandError("--dir writes one text or json file per pass: use it without --out and --format html")
    if options.pipeline and (options.format != "text" or options.dir is not None):
        raise CommandError("--pipeline applies to --format text only, without --dir")
    if options.kernels and (options.format != "text" or options.dir is not None):
        raise CommandError("--kernels applies to --format text only, without --dir")


def _single(options: argparse.Namespace) -> bool:
    """One Program, printed bare (no timing header, so runs diff cleanly), or several under headers."""
    return options.after != "all" and not options.after_change


def _select(history: History, options: argparse.Namespace) -> list[PassRecord]:
    if options.after_change:
        return [r for r in history if r.report.changed]
    if options.after == "all" or (options.after is None and (options.format == "html" or options.dir is not None)):
        return list(history)
    if options.after is None:
        return [history[-1]]
    if options.after not in history.names():
        raise CommandError(f"pass {options.after!r} did not run under this strategy; passes that ran: "
                           f"{', '.join(history.names())}")
    return [history[options.after]]


def format_memory(memory: MemoryEstimate) -> str:
    """Estimated live bytes after each op of the global block, then the peak, as comment lines."""
    width = max((len(name) for name, _ in memory.live_after_op), default=0)
    lines = ["# estimated live bytes after each op (persistables and feeds included):"]
    lines += [f"#   {name:<{width}}  {live}" for name, live in memory.live_after_op]
    lines.append(f"# peak: {memory.peak_bytes} bytes ({memory.peak_bytes / 2**20:.2f} MiB) "
                 f"after op {memory.peak_op or '-'}")
    if memory.formula:  # a dynamic Program: the numbers are at its traced sizes
        sizes = ", ".join(f"{name}={size}" for name, size in memory.sizes.items())
        lines.append(f"# peak formula: {memory.formula} bytes (the numbers above are for {sizes})")
    return "\n".join(lines)


def _render_text(history: History, records: list[PassRecord], options: argparse.Namespace) -> str:
    chunks = []
    for record in records:
        chunks.append(str(record.program) if _single(options) else str(record))
        if options.memory:
            chunks.append(format_memory(record.memory))
        if not _single(options) and (diff := history.diff(record.name)):
            chunks.append(diff.rstrip("\n"))
    return "\n".join(chunks) + "\n"


def _render_json(records: list[PassRecord], options: argparse.Namespace) -> str:
    if _single(options):
        return program_to_json(records[0].program) + "\n"
    return json.dumps([{"pass": r.name, "program": to_dict(r.program)} for r in records]) + "\n"


def dump_ir(options: argparse.Namespace) -> int:
    """Compile the factory's model (running one training step) and print the selected Programs."""
    _check_options(options)
    spec = _step_spec(_call_factory(_import_factory(options.factory), options.factory), options.factory)
    strategy = _load_strategy(options.strategy) if options.strategy else spec.strategy
    trainer = fleetc.compile(spec.model, strategy, optimizer=spec.optimizer, loss_fn=spec.loss_fn,
                             verify=options.verify, disable_passes=options.disable_pass,
                             dynamic=True if options.dynamic else None)
    trainer.step(*spec.args, **spec.kwargs)
    records = _select(trainer.history, options)
    if options.dir is not None:
        try:
            written = write_pass_files(trainer.history, records, options.dir, options.format)
        except OSError as exc:
            raise CommandError(f"cannot write to directory {options.dir!r}: {exc}") from None
        sys.stdout.write("".join(f"{path}\n" for path in written))
        return 0
    if options.format == "json":
        text = _render_json(records, options)
    elif options.format == "html":
        text = report_html(records, title=f"fleetc dump-ir {options.factory}")
    else:
        text = _render_text(trainer.history, records, options)
    if options.kernels:
        text += format_kernels(records[-1].program) + format_cpu_kernels(records[-1].program)
    if options.pipeline:
        text += format_pipeline(records[-1].program)
    if options.out is None:
        sys.stdout.write(text)
        return 0
    try:
        write_atomically(options.out, text)
    except OSError as exc:
        raise CommandError(f"cannot write {options.out!r}: {exc}") from None
    return 0


_EXPORT_DESCRIPTION = """\
Export a model for inference, as fleet.save_inference_model does: DIR gets model.pt2 (a
torch.export ExportedProgram of the eval Program, fleetc's ops lowered to aten, pruned to the
targets, float32; with use_pure_fp16 also model.<dtype>.pt2) and meta.json. Load it with
torch.export.load(DIR/model.pt2).module() in any PyTorch process, or fleetc.load_inference_model(DIR).

FACTORY is `package.module:function`, as for dump-ir (model, args, kwargs, loss_fn, optimizer,
strategy). Nothing is trained: the factory's weights are exported. The example inputs are `args`
(without the last one, the target, when `loss_fn` is given) and `kwargs`, by forward argument name.
Bad input (factory, names, directory) prints one line and exits with status 2.
"""


def export(options: argparse.Namespace) -> int:
    """Export the factory's model (its current weights) into options.out; prints the files written."""
    spec = _step_spec(_import_factory(options.factory)(), options.factory)
    strategy = _load_strategy(options.strategy) if options.strategy else spec.strategy
    args = spec.args[:-1] if spec.loss_fn is not None else spec.args
    try:
        inputs = export_sources.named_inputs(spec.model, args, spec.kwargs)
        feeds = options.feed or list(inputs)
        unknown = [name for name in feeds if name not in inputs]
        if unknown:
            export_sources.check_feed_names(spec.model, unknown)
            raise CommandError(f"--feed {unknown[0]!r}: the factory gives no example input of that name "
                               f"(inputs: {', '.join(inputs)})")
        inference.check_writable(options.out)
        trainer = fleetc.compile(spec.model, strategy, optimizer=spec.optimizer, loss_fn=spec.loss_fn,
                                 verify=options.verify)
        with warnings.catch_warnings():  # the notes are printed below, as the command's own lines
            warnings.simplefilter("ignore")
            result = inference.save_inference_model(trainer, options.out, feeds, options.target or None,
                                                    export_for_deployment=not options.no_prune,
                                                    inputs={name: inputs[name] for name in feeds},
                                                    dynamic_batch=not options.static_batch)
    except ExportError as exc:
        raise CommandError(str(exc)) from None
    for note in result.meta["notes"]:
        print(f"fleetc export: note: {note}", file=sys.stderr)
    for name in [*result.meta["files"].values(), inference.META_FILE]:
        sys.stdout.write(os.path.join(options.out, name) + "\n")
    return 0


def shard_plan(options: argparse.Namespace) -> int:
    """Compile the factory's step in this process and print every rank's sharding plan for --world-size ranks,
    beside what the real trainer holds on the --measure-ranks ranks under torch's fake process group."""
    def make() -> tuple[StepSpec, Any]:
        spec = _step_spec(_call_factory(_import_factory(options.factory), options.factory), options.factory)
        return spec, _load_strategy(options.strategy) if options.strategy else spec.strategy

    spec, strategy = make()
    trainer = fleetc.compile(spec.model, strategy, optimizer=spec.optimizer, loss_fn=spec.loss_fn)
    if not trainer.config.sharding:
        raise CommandError("the strategy does not turn sharding on (strategy.sharding = True)")
    trainer.step(*spec.args, **spec.kwargs)
    mesh, plans = plan_for_world(trainer, options.world_size)
    ranks = _measured_ranks(options.measure_ranks, plans)

    def rank_trainer() -> tuple[DataParallelTrainer, tuple, dict]:
        spec, strategy = make()
        return (DataParallelTrainer(spec.model, strategy, optimizer=spec.optimizer, loss_fn=spec.loss_fn),
                spec.args, spec.kwargs)

    measured = measure_ranks(rank_trainer, mesh, ranks)
    sys.stdout.write(format_plans(mesh, plans, trainer.config.sharding_configs.stage, measured))
    return 0


def _measured_ranks(text: str | None, plans: list[RankPlan]) -> list[int]:
    """--measure-ranks: default a few representative ranks, 'all', 'none', or a comma-separated list."""
    if text is None:
        return representative_ranks(plans)
    if text in ("all", "none"):
        return [p.rank for p in plans] if text == "all" else []
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise CommandError(f"--measure-ranks {text!r}: expected 'all', 'none' or ranks like 0,63") from None
    outside = [r for r in ranks if not 0 <= r < len(plans)]
    if outside:
        raise CommandError(f"--measure-ranks {text!r}: rank(s) {outside} are outside the sharding group "
                           f"(ranks 0 to {len(plans) - 1})")
    return ranks


def build_parser() -> argparse.ArgumentParser:
    """The `fleetc` parser; each subcommand stores its handler in `handler`."""
    parser = argparse.ArgumentParser(prog="fleetc", description="fleetc: a graph compiler for PyTorch training.",
                                     epilog="Run `fleetc COMMAND --help` for the options of a command.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    dump = commands.add_parser("dump-ir", help="print a model's Program after a compiler pass",
                               description=_DUMP_IR_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    dump.set_defaults(handler=dump_ir)
    dump.add_argument("factory", metavar="FACTORY", help="package.module:function returning the model and inputs")
    dump.add_argument("--strategy", metavar="FILE",
                      help="a DistributedStrategy as .json or .prototxt; overrides the factory's strategy")
    which = dump.add_mutually_exclusive_group()
    which.add_argument("--after", metavar="PASS",
                       help="print the Program after PASS ('capture' or a pass name), or after every pass "
                            "with 'all', each under its provenance header (default: after the last pass)")
    which.add_argument("--after-change", action="store_true",
                       help="print only the passes that changed the Program, each with a diff against the one before "
                            "(--after all prints the diffs too)")
    dump.add_argument("--format", choices=("text", "json", "html"), default="text",
                      help="text (the readable listing), json (the exact round-trippable form) or html (one "
                           "self-contained page, a section per pass, every pass unless --after/--after-change "
                           "choose); default text")
    dump.add_argument("--out", metavar="PATH", help="write to PATH (atomically) instead of standard output")
    dump.add_argument("--dir", metavar="DIR",
                      help="write one numbered file per pass (000_capture.txt, 001_<pass>.txt, ...; .json with "
                           "--format json) into DIR for diff/git diff, every pass unless --after/--after-change "
                           "choose; earlier numbered dumps in DIR are replaced; prints the paths written")
    dump.add_argument("--disable-pass", metavar="NAME", action="append", default=[],
                      help="skip the pass NAME (repeatable); passes: " + ", ".join(all_pass_names()))
    dump.add_argument("--memory", action="store_true",
                      help="after each Program, list the estimated live bytes after every op and the peak")
    dump.add_argument("--verify", action="store_true", help="run the IR verifier after every pass")
    dump.add_argument("--dynamic", action="store_true",
                      help="trace the batch and sequence dims symbolically (docs/dynamic_shapes.md); with --memory "
                           "the peak is also printed as a formula in them")
    dump.add_argument("--pipeline", action="store_true",
                      help="append the pipeline schedule, its simulation and each stage's Programs (pipeline on)")
    dump.add_argument("--kernels", action="store_true",
                      help="after the Program, print the Triton (CUDA) and C++ (CPU) source generated for each fused op "
                           "(text format)")
    exporter = commands.add_parser("export", help="export a model for inference (torch.export .pt2 + meta.json)",
                                   description=_EXPORT_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    exporter.set_defaults(handler=export)
    exporter.add_argument("factory", metavar="FACTORY", help="package.module:function returning the model and inputs")
    exporter.add_argument("--out", metavar="DIR", required=True,
                          help="the directory to write (replaced atomically if it exists)")
    exporter.add_argument("--strategy", metavar="FILE",
                          help="a DistributedStrategy as .json or .prototxt; overrides the factory's strategy")
    exporter.add_argument("--feed", metavar="NAME", action="append", default=[],
                          help="a forward argument the exported model takes (repeatable; default: every example input)")
    exporter.add_argument("--target", metavar="NAME", action="append", default=[],
                          help="what the exported model returns: 'output' (default), 'output.<i>', a module path or "
                               "a value of the eval Program (repeatable)")
    exporter.add_argument("--no-prune", action="store_true",
                          help="keep every op of the eval Program (export_for_deployment=False)")
    exporter.add_argument("--static-batch", action="store_true", help="export the batch dimension static")
    exporter.add_argument("--verify", action="store_true", help="run the IR verifier after every compiler pass")
    add_run_command(commands)
    add_explain_command(commands, lambda spec: _step_spec(_call_factory(_import_factory(spec), spec), spec))
    planner = commands.add_parser("shard-plan", help="every rank's sharding plan and memory for a world size, "
                                                     "before launching")
    planner.set_defaults(handler=shard_plan)
    planner.add_argument("factory", metavar="FACTORY", help="package.module:function returning the model and inputs")
    planner.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks to plan for")
    planner.add_argument("--strategy", metavar="FILE",
                         help="a DistributedStrategy as .json or .prototxt; overrides the factory's strategy")
    planner.add_argument("--measure-ranks", metavar="all|none|N,M",
                         help="sharding ranks whose real trainer runs one step under torch's fake process group, "
                              "its held bytes printed as 'measured MB' (default: the first, the last and one "
                              "whose piece is padding only, if any)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `fleetc` command line; returns the exit status (2: bad input, 1: compile failed)."""
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return options.handler(options)
    except CommandError as exc:
        print(f"fleetc {options.command}: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    except FleetcError as exc:
        print(f"fleetc {options.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

"""A picture of a Program's dataflow (or one module's ops) as self-contained SVG, laid out here in layers.

networkx (a pip dependency) orders the ops into layers; the SVG needs no script and no system package.
Without networkx the picture falls back to a text listing of each op and its consumers, with a note.
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetc.ir.liveness import block_reads
from fleetc.ir.printer import ProgramPrinter
from fleetc.ir.program import Op, Program
from fleetc.strategy.names import closest
from fleetc.viz.style import (
    ROLE_BORDERS,
    ROLE_COLOURS,
    esc,
    fusion_marks,
    primary_role,
    wrap,
)

NODE_W, NODE_H, GAP_X, GAP_Y, MARGIN = 168, 26, 16, 34, 10
LABEL_CHARS = 24


@dataclass
class GraphPicture:
    """An SVG picture (None when no renderer is available) plus the same graph as text."""

    svg: str | None
    text: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.note}\n{self.text}" if self.note else self.text

    def _repr_html_(self) -> str:
        if self.svg is None:
            return wrap(f'<p class="note">{esc(self.note)}</p><pre>{esc(self.text)}</pre>')
        return wrap(f'<div class="scroll">{self.svg}</div>')


def short_type(op: Op) -> str:
    """`aten.addmm.default` → `addmm`, `fleetc.fused_bn_act` → `fused_bn_act`."""
    name = op.type.removeprefix("aten.").removeprefix("fleetc.")
    return name.removesuffix(".default")


def _selected_ops(program: Program, module: str | None, block_idx: int) -> list[Op]:
    ops = program.blocks[block_idx].ops
    if module is None:
        return list(ops)
    chosen = [op for op in ops if op.module_path == module or op.module_path.startswith(module + ".")]
    if not chosen:
        paths = sorted({op.module_path for op in ops if op.module_path})
        match = closest(module, paths)
        hint = f"; did you mean {match!r}?" if match else f"; module paths: {', '.join(paths[:12])}"
        raise ValueError(f"no op of block {block_idx} has module path {module!r}{hint}")
    return chosen


def _edges(program: Program, ops: list[Op]) -> list[tuple[int, int]]:
    """(producer, consumer) positions among `ops`, one per distinct pair; a read sees the latest write before it
    (in-place updates such as `fleetc.sgd` redefine a parameter that earlier ops read)."""
    producer: dict[str, int] = {}
    edges = []
    for j, op in enumerate(ops):
        sources = {producer[name] for name in block_reads(program, op) if name in producer}
        edges += [(i, j) for i in sorted(sources)]
        producer.update((name, j) for name in op.defined)
    return edges


def _text(ops: list[Op], edges: list[tuple[int, int]]) -> str:
    consumers: dict[int, list[int]] = {}
    for i, j in edges:
        consumers.setdefault(i, []).append(j)
    return "\n".join(f"[{i}] {short_type(op)} ({op.name}) -> "
                     + (", ".join(f"[{j}]" for j in consumers.get(i, [])) or "-") for i, op in enumerate(ops))


def _layers(count: int, edges: list[tuple[int, int]]) -> list[list[int]]:
    """Ops in layers (each after everything it reads), ordered within a layer by their inputs' positions."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(range(count))
    graph.add_edges_from(edges)
    column: dict[int, float] = {}

    def barycenter(node: int) -> float:  # the mean column of its inputs, so arrows run mostly straight down
        placed = [column[p] for p in graph.predecessors(node)]
        return sum(placed) / len(placed) if placed else float(node)

    layers = []
    for generation in nx.topological_generations(graph):
        layer = sorted(sorted(generation), key=barycenter)
        column.update((node, x) for x, node in enumerate(layer))
        layers.append(layer)
    return layers


def _svg(program: Program, ops: list[Op], edges: list[tuple[int, int]], layers: list[list[int]],
         block_idx: int) -> str:
    printer = ProgramPrinter(program)
    width = MARGIN * 2 + max(len(layer) for layer in layers) * (NODE_W + GAP_X)
    height = MARGIN * 2 + len(layers) * (NODE_H + GAP_Y)
    where = {}
    for row, layer in enumerate(layers):
        for col, node in enumerate(layer):
            where[node] = (MARGIN + col * (NODE_W + GAP_X), MARGIN + row * (NODE_H + GAP_Y))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
             '<defs><marker id="fleetc-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" '
             'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#6b7280"/></marker></defs>']
    for i, j in edges:
        (x1, y1), (x2, y2) = where[i], where[j]
        sx, sy, tx, ty = x1 + NODE_W / 2, y1 + NODE_H, x2 + NODE_W / 2, y2
        mid = (sy + ty) / 2
        parts.append(f'<path d="M{sx:.0f},{sy:.0f} C{sx:.0f},{mid:.0f} {tx:.0f},{mid:.0f} {tx:.0f},{ty:.0f}" '
                     'fill="none" stroke="#9ca3af" marker-end="url(#fleetc-arrow)"/>')
    for node, op in enumerate(ops):
        x, y = where[node]
        role = primary_role(op)
        fused = bool(fusion_marks(op))
        label = short_type(op)
        label = label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"
        parts.append(f'<g class="node" data-op="{esc(op.name)}"><title>{esc(printer.op_line(op, block_idx))}'
                     f'</title><rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" '
                     f'fill="{ROLE_COLOURS[role]}" stroke="{ROLE_BORDERS[role]}" '
                     f'stroke-width="{3 if fused else 1}"/><text x="{x + 6}" y="{y + 17}">{esc(label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def program_graph(program: Program, module: str | None = None, block: int = 0) -> GraphPicture:
    """The dataflow between the ops of one block, or only those of `module` (and its sub-modules).

    Boxes are coloured by role and drawn thick for fused ops; hovering shows the op's full line.
    """
    ops = _selected_ops(program, module, block)
    edges = _edges(program, ops)
    text = _text(ops, edges)
    try:
        layers = _layers(len(ops), edges)
    except ImportError:
        return GraphPicture(None, text, "networkx is not installed, so the graph is shown as text "
                                        "(pip install networkx for the picture)")
    return GraphPicture(_svg(program, ops, edges, layers, block), text)

"""The min-cut plan ("auto") solved piece by piece, once per distinct piece of the repeated blocks (issue 25).

Many edges of auto.py's flow network can never be cut: an edge out of a node tied to the sink (a value backward
reads) or into a node tied to the source (a value the policy saves) never runs from the source side of a finite cut
to its sink side. Without those edges the network falls apart into small independent pieces, each inside one block
or across two neighbouring ones. A cut's capacity is then the sum of its pieces' capacities, so the minimum cuts of
the whole network are exactly the combinations of minimum cuts of its pieces, and the cut networkx returns (the
largest source side of a minimum cut: everything that cannot reach the sink in the residual network) is the union
of the pieces' largest source sides. Each piece is therefore solved alone, and a piece that reads like an earlier
one once the names of its blocks are taken out (the same nodes, edges, capacities and ties to source and sink, under
`find_block_copies`' verified name correspondence) takes that piece's answer, renamed: the plan is the one the
whole network gives (tests/passes/test_block_reuse.py asserts that the Programs print identically).

`FLEETC_BLOCK_REUSE` decides (`reuse_enabled("recompute")`); off, auto.py cuts the whole network at once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

from fleetc.ir.block_copies import BlockCopies, find_block_copies
from fleetc.passes.recompute.plan import ForwardRegion

SOURCE, SINK = "source", "sink"
_OUTSIDE = -1  # the tag of a node whose value no verified block copy makes: named as it is
_INFINITE = -1  # an edge without capacity (networkx: unbounded)


@dataclass
class PieceCut:
    """The minimum cut of the whole network assembled from its pieces, and how many pieces each block reused."""

    capacity: int = 0
    source_side: set[str] = field(default_factory=set)
    solved: Counter = field(default_factory=Counter)  # instance → pieces touching it that were solved
    reused: Counter = field(default_factory=Counter)  # instance → pieces touching it that took an earlier answer

    def lines(self, copies: BlockCopies) -> list[str]:
        """`15 of 16 blocks like encoder.layers.0 took every min-cut piece from an identical earlier one (…)`."""
        result = []
        for reference in copies.references():
            members = copies.members(reference)
            reused = [m for m in members if not self.solved[m]]
            result.append(f"{len(reused)} of {len(members)} blocks like {reference} took every min-cut piece from "
                          f"an identical earlier one ({sum(self.solved[m] for m in members)} pieces solved, "
                          f"{sum(self.reused[m] for m in members)} reused)")
        return result


def _pieces(graph: nx.DiGraph) -> list[set[str]]:
    """The node sets (source and sink left out) that the edges a finite cut may cut hold together, in node order."""
    source_tied, sink_tied = set(graph.successors(SOURCE)), set(graph.predecessors(SINK))
    live = nx.Graph()
    live.add_nodes_from(n for n in graph if n not in (SOURCE, SINK))
    live.add_edges_from((a, b) for a, b in graph.edges
                        if a != SOURCE and b != SINK and a not in sink_tied and b not in source_tied)
    return list(nx.connected_components(live))


class _Labeller:
    """Names a node after its block: (tag, the reference block's name of its value, in/out), where tag numbers the
    blocks a piece touches in Program order, or `_OUTSIDE` and the node's own name."""

    def __init__(self, region: ForwardRegion, copies: BlockCopies):
        self.region, self.copies = region, copies

    def instance(self, node: str) -> str | None:
        value = node.rsplit("_", 1)[0]
        return self.copies.block_of.get(self.region.producer[value].name)

    def labels(self, piece: set[str]) -> tuple[list[str], dict[str, tuple]]:
        """The blocks `piece` touches (in Program order) and each node's label."""
        instance_of = {node: self.instance(node) for node in piece}
        blocks = sorted({i for i in instance_of.values() if i is not None}, key=lambda i: self.copies.slots[i][0])
        tag = {instance: t for t, instance in enumerate(blocks)}
        labels = {}
        for node, instance in instance_of.items():
            if instance is None:
                labels[node] = (_OUTSIDE, node)
            else:
                value, side = node.rsplit("_", 1)
                labels[node] = (tag[instance], self.copies.to_reference[instance][value], side)
        return blocks, labels


def _key(graph: nx.DiGraph, piece: set[str], blocks: list[str], labels: dict[str, tuple],
         copies: BlockCopies) -> tuple:
    """All that the piece's minimum cut depends on, with its blocks' names taken out."""
    ties = sorted((labels[n], graph.has_edge(SOURCE, n), graph.has_edge(n, SINK)) for n in piece)
    edges = sorted((labels[a], labels[b], d.get("capacity", _INFINITE))
                   for a in piece for b, d in graph.succ[a].items() if b in piece)
    return tuple(copies.reference[b] for b in blocks), tuple(ties), tuple(edges)


def _solve(graph: nx.DiGraph, piece: set[str]) -> tuple[int, set[str]]:
    """The piece's minimum cut alone: its capacity and largest source side (without the source itself)."""
    network = nx.DiGraph()
    network.add_nodes_from((SOURCE, SINK, *piece))
    for a in piece:
        if graph.has_edge(SOURCE, a):
            network.add_edge(SOURCE, a)
        for b, data in graph.succ[a].items():
            if b == SINK or b in piece:
                network.add_edge(a, b, **data)
    capacity, (reachable, _) = nx.minimum_cut(network, SOURCE, SINK)
    return capacity, reachable - {SOURCE}


def cut_by_pieces(region: ForwardRegion, graph: nx.DiGraph) -> tuple[PieceCut, BlockCopies]:
    """The minimum cut `nx.minimum_cut(graph, "source", "sink")` gives, solved once per distinct piece."""
    copies = find_block_copies(region.program)
    labeller = _Labeller(region, copies)
    answers: dict[tuple, tuple[int, frozenset]] = {}
    cut = PieceCut()
    for piece in _pieces(graph):
        blocks, labels = labeller.labels(piece)
        key = _key(graph, piece, blocks, labels, copies) if blocks else None
        if key is not None and key in answers:
            capacity, source_labels = answers[key]
            cut.source_side |= {n for n in piece if labels[n] in source_labels}
            cut.reused.update(blocks)
        else:
            capacity, source_side = _solve(graph, piece)
            if key is not None:
                answers[key] = capacity, frozenset(labels[n] for n in source_side)
            cut.source_side |= source_side
            cut.solved.update(blocks)
        cut.capacity += capacity
    return cut, copies

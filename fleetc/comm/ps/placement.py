"""Where each parameter lives on the servers: dense parameters whole, by size; embedding tables row-sharded by id."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """`dense[name]` is the server holding that parameter; `tables[name]` is (rows, dim) of a table whose row `i`
    lives on server `i % server_num` as local row `i // server_num`."""

    server_num: int
    dense: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)

    def dense_on(self, server: int) -> list[str]:
        return [name for name, s in self.dense.items() if s == server]

    def local_rows(self, rows: int, server: int) -> int:
        """How many of a table's `rows` live on `server`."""
        return len(range(server, rows, self.server_num))

    def to_data(self) -> dict:
        return {"server_num": self.server_num, "dense": dict(self.dense),
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "tables": {k: list(v) for k, v in self.tables.items()}}


def place(shapes: dict[str, tuple[int, ...]], tables: set[str], server_num: int) -> Placement:
    """Tables (2-D, in `tables`) are row-sharded over every server; each dense parameter goes whole to the server
    holding the fewest elements so far, largest parameters first (ties: lower server index, then name order)."""
    load = [0] * server_num
    dense: dict[str, int] = {}
    for name in sorted((n for n in shapes if n not in tables), key=lambda n: (-_numel(shapes[n]), n)):
        server = min(range(server_num), key=lambda s: (load[s], s))
        dense[name] = server
        load[server] += _numel(shapes[name])
    table_shapes = {n: (int(shapes[n][0]), int(shapes[n][1])) for n in shapes if n in tables}
    return Placement(server_num, dense, {n: tuple(s) for n, s in shapes.items()}, table_shapes)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel

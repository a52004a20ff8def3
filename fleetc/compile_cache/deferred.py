"""A captured Program read from a compile cache entry, whose ops and Vars are decoded only when first used.

On a full hit (capture and passes both skipped) the captured Program is needed only for its metadata (the guard
check reads `attribute_reads`), its op count (the report and the capture history record) and its JSON text (the
passes key hashes it); the final Program comes from the passes entry. Decoding and building ~5k ops and ~14k Vars
of a 32-layer capture cost about 0.1 s, a fifth of a warm start, for nothing. So the entry's text is scanned only
up to its metadata (fleetc's writer puts the blocks last), through the same restricted decoder as a whole Program,
and the rest is decoded by `program_from_json` when something reads the blocks, feeds or fetches (a passes miss,
`verify=True`, printing `trainer.history[0].program`). That decode checks that the op count stored beside the text
and the metadata the guard check used are the text's own; an entry that fails it raises CompileCacheError, which
the compile that hit it answers by capturing again (CompileCache.capture_again). A first use after the compile (a
full hit's `trainer.history[0].program`) calls `rebuild` instead, which the compile sets
(CompileCache.rebuild_when_damaged): it warns naming the entry file and captures the model again.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from fleetc.errors import FleetcError
from fleetc.ir.program import Program
from fleetc.ir.serialize import (
    FORMAT_KEY,
    FORMAT_VERSION,
    decode_value,
    program_from_json,
)

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")
__all__ = ["CompileCacheError", "DeferredProgram", "program_header"]

_LAST_FIELD = "blocks"  # program_to_json writes it last: every field before it is small


class CompileCacheError(FleetcError, ValueError):
    """A compile cache entry that passed its load checks turned out not to decode when its Program was used;
    `reason` says what is wrong with the entry `source`."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source} {reason}; delete it and compile again")
        self.source, self.reason = source, reason


def program_header(text: str) -> dict[str, Any]:
    """The top-level fields of Program JSON text that come before its blocks, JSON-parsed (not yet decoded);
    ValueError when the text does not start as `program_to_json` writes it."""
    pos = _SPACE.match(text, 0).end()
    if text[pos:pos + 1] != "{":
        raise ValueError("Program text does not start with a JSON object")
    fields: dict[str, Any] = {}
    pos += 1
    while True:
        pos = _SPACE.match(text, pos).end()
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _SPACE.match(text, pos).end()
        if not isinstance(key, str) or text[pos:pos + 1] != ":":
            raise ValueError(f"Program text has a malformed field near character {pos}")
        if key == _LAST_FIELD:
            return fields
        value, pos = _DECODER.raw_decode(text, _SPACE.match(text, pos + 1).end())
        fields[key] = value
        pos = _SPACE.match(text, pos).end()
        if text[pos:pos + 1] != ",":
            raise ValueError(f"Program text has no {_LAST_FIELD!r} field after its {key!r} field")
        pos += 1


def _delegated(name: str) -> property:
    def get(self: DeferredProgram) -> Any:
        return getattr(self.decoded(), name)

    def set_(self: DeferredProgram, value: Any) -> None:
        setattr(self.decoded(), name, value)

    return property(get, set_, doc=f"The decoded Program's `{name}`.")


class DeferredProgram(Program):
    """A Program whose metadata and op count are known and whose blocks, feeds and fetches are decoded from
    `text` on first use. `clone()` gives a plain Program, so passes never see this class. `rebuild`, when set,
    answers an entry that does not decode with a Program built another way (the error says why); unset, the
    CompileCacheError is raised."""

    blocks = _delegated("blocks")
    feeds = _delegated("feeds")
    fetches = _delegated("fetches")

    def __init__(self, text: str, ops: int, source: str):  # Program's fields are properties here
        header = program_header(text)
        if header.get(FORMAT_KEY) != FORMAT_VERSION:
            raise ValueError(f"not a fleetc Program of format version {FORMAT_VERSION}")
        if not isinstance(header.get("metadata"), dict) or not isinstance(ops, int) or isinstance(ops, bool):
            raise TypeError("the entry's Program has no metadata object or no op count")
        self.metadata = decode_value(header["metadata"])
        self._text, self._ops, self._source = text, ops, source
        self._full: Program | None = None
        self.rebuild: Callable[[CompileCacheError], Program] | None = None

    def decoded(self) -> Program:
        """The whole Program (decoded once, checked against what was used before it was decoded; else rebuilt)."""
        if self._full is None:
            try:
                full = self._decode()
            except CompileCacheError as exc:
                if self.rebuild is None:
                    raise
                full = self.rebuild(exc)
                self.metadata = full.metadata
            self._full = full
        return self._full

    def _decode(self) -> Program:
        try:
            full = program_from_json(self._text)
        except (KeyError, TypeError, ValueError) as exc:
            raise CompileCacheError(self._source, f"does not decode ({type(exc).__name__}: {exc})") from exc
        if full.num_ops() != self._ops or full.metadata != self.metadata:
            raise CompileCacheError(self._source, "is inconsistent: its op count or metadata differs from its "
                                    "Program's")
        full.metadata = self.metadata  # one dict, whoever edits it
        return full

    def num_ops(self) -> int:
        return self._ops if self._full is None else self._full.num_ops()

    def clone(self) -> Program:
        return self.decoded().clone()

    def __eq__(self, other: object) -> bool:
        return self.decoded() == other if isinstance(other, Program) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as Program's


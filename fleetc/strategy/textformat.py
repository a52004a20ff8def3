"""Protobuf text format, the syntax only: parse it into entries and quote strings for writing.

The grammar handled is the part strategy files use: ``name: value``, ``name { ... }`` (or
``< ... >``, with an optional colon), ``name: [v1, v2]`` for repeated scalars, ``#`` comments,
optional ``,``/``;`` separators, quoted strings with C-style escapes (adjacent strings
concatenate), decimal numbers and bare words (``true``, ``false``, enum values). What the
names mean is not this module's business.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetc.errors import StrategyError


class Word(str):
    """A bare word in the file (``true``, ``FThenB``), as opposed to a quoted string."""


@dataclass(frozen=True)
class Entry:
    """One ``name: value`` or ``name { ... }`` item; ``children`` is None for a scalar."""

    name: str
    line: int
    value: Any = None
    children: tuple[Entry, ...] | None = None


_TOKEN = re.compile(
    r"""
    (?P<newline>\n)
  | (?P<space>[ \t\r\f\v]+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?[fF]?|(?:inf|infinity|nan)\b))
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[:{}<>\[\],;])
    """,
    re.VERBOSE | re.IGNORECASE,
)

_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))")
_SIMPLE_ESCAPES = {
    "n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v",
    "\\": "\\", "'": "'", '"': '"', "?": "?",
}
_CLOSING = {"{": "}", "<": ">"}


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    line: int


MAX_DEPTH = 16  # strategy files nest two levels; deeper input is refused before it can exhaust the stack


def read_source(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of a strategy file; an unreadable or undecodable file is a StrategyError naming it
    (and the line of the first bad byte)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StrategyError(f"{os.fspath(path)}: cannot read the strategy file: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise StrategyError(f"{os.fspath(path)}:{line}: not UTF-8 text (byte {data[exc.start]:#04x}); "
                            "a strategy file is prototxt or JSON text") from None


def parse(text: str, source: str) -> tuple[Entry, ...]:
    """Parse a whole text-format message; errors are StrategyError naming ``source:line``."""
    return _Parser(_tokenize(text, source), source).message(closing=None)


def quote(value: str) -> str:
    """Spell ``value`` as a double-quoted text-format string (non-ASCII is kept as UTF-8)."""
    out = []
    for char in value:
        if char in '\\"':
            out.append("\\" + char)
        elif char in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\{ord(char):03o}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _tokenize(text: str, source: str) -> list[_Token]:
    tokens = []
    line, pos = 1, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise StrategyError(f"{source}:{line}: unexpected character {text[pos]!r}")
        kind = match.lastgroup
        if kind == "newline":
            line += 1
        elif kind not in ("space", "comment"):
            tokens.append(_Token(kind, match.group(), line))
        pos = match.end()
    tokens.append(_Token("end", "", line))
    return tokens


class _Parser:
    """Recursive descent over the token list; one method per grammar rule."""

    def __init__(self, tokens: list[_Token], source: str) -> None:
        self.tokens = tokens
        self.pos = 0
        self.source = source
        self.depth = 0

    def error(self, message: str, token: _Token) -> StrategyError:
        return StrategyError(f"{self.source}:{token.line}: {message}")

    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def take(self) -> _Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def take_punct(self, *texts: str) -> _Token | None:
        token = self.peek()
        if token.kind == "punct" and token.text in texts:
            return self.take()
        return None

    def message(self, closing: str | None) -> tuple[Entry, ...]:
        entries: list[Entry] = []
        while True:
            token = self.peek()
            if closing is None and token.kind == "end":
                return tuple(entries)
            if closing is not None and self.take_punct(closing):
                return tuple(entries)
            if token.kind == "end":
                raise self.error(f"missing {closing!r} before the end of the file", token)
            entries.extend(self.field())
            self.take_punct(",", ";")

    def field(self) -> list[Entry]:
        name = self.take()
        if name.kind != "word":
            raise self.error(f"expected a field name, got {name.text!r}", name)
        has_colon = self.take_punct(":") is not None
        opening = self.take_punct("{", "<")
        if opening:
            if self.depth == MAX_DEPTH:
                raise self.error(f"blocks nested more than {MAX_DEPTH} levels deep", opening)
            self.depth += 1
            children = self.message(closing=_CLOSING[opening.text])
            self.depth -= 1
            return [Entry(name.text, name.line, children=children)]
        if not has_colon:
            raise self.error(f"expected ':' or '{{' after {name.text!r}", self.peek())
        if self.take_punct("["):
            return [Entry(name.text, name.line, value=v) for v in self.scalar_list()]
        return [Entry(name.text, name.line, value=self.scalar())]

    def scalar_list(self) -> list[Any]:
        values: list[Any] = []
        if self.take_punct("]"):
            return values
        while True:
            values.append(self.scalar())
            if self.take_punct("]"):
                return values
            if not self.take_punct(","):
                raise self.error("expected ',' or ']' in a list", self.peek())

    def scalar(self) -> Any:
        token = self.take()
        if token.kind == "string":
            pieces = [self.unquote(token)]
            while self.peek().kind == "string":
                pieces.append(self.unquote(self.take()))
            return "".join(pieces)
        if token.kind == "number":
            return _number(token.text)
        if token.kind == "word":
            return Word(token.text)
        raise self.error(f"expected a value, got {token.text or 'the end of the file'!r}", token)

    def unquote(self, token: _Token) -> str:
        body = token.text[1:-1]
        data = bytearray()
        last = 0
        for match in _ESCAPE.finditer(body):
            data += body[last:match.start()].encode("utf-8")
            octal, hex_byte, short_code, long_code, simple = match.groups()
            if octal or hex_byte:
                data.append(int(octal, 8) if octal else int(hex_byte, 16))
            elif short_code or long_code:
                code = int(short_code or long_code, 16)
                if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    raise self.error(f"invalid unicode escape '{match.group()}' in string", token)
                data += chr(code).encode("utf-8")
            elif simple in _SIMPLE_ESCAPES:
                data += _SIMPLE_ESCAPES[simple].encode("utf-8")
            else:
                raise self.error(f"invalid escape '\\{simple}' in string", token)
            last = match.end()
        data += body[last:].encode("utf-8")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"string is not valid UTF-8 ({exc.reason})", token) from None


def _number(text: str) -> int | float:
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if text[-1] in "fF" and text[-2] in "0123456789.":
        text = text[:-1]  # C-style float suffix, as in ``1.5f``
    return float(text)

"""Reads the Program text form (`str(program)`, `fleetc.ir.printer`) back into an equal Program.

Blank lines and whole-line comments (`#` or `//` first) are skipped, so `str(pass_record)` and pass fixtures parse
too. Every problem raises `ProgramParseError` naming the line and what was expected there.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch

from fleetc.errors import ProgramParseError
from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.text_syntax import (
    ABSENT,
    DTYPE_LONG,
    DTYPES,
    FLOAT,
    INT,
    KEY,
    NAME,
    NOTE_KEYS,
    NOTE_TOKEN,
    SOURCE_NOTE,
    STRING,
    TORCH_CONSTANTS,
    TYPE,
    shape_symbols,
)

_HEADER = re.compile(r"program(?: (\S+))?: (\d+) ops, (\d+) block\(s\)")
_BLOCK = re.compile(r"block (\d+)(?: \(parent (-?\d+)\))? \{")
_KINDS = {kind.value: kind for kind in VarKind}
_CONSTANTS = {"True": True, "False": False, "None": None, "inf": float("inf"), "nan": float("nan")}
_NOTE_KV = re.compile(r"(\w+)=(.*)")
_NOTE_FIELDS = ("name", "module_path", "source", *NOTE_KEYS)
_KEYWORD = re.compile(f"(?:{KEY.pattern}|{STRING.pattern})=")
_CONSTRUCTORS: dict[str, Callable[[str], Any]] = {
    "device": torch.device,
    "sym": lambda text: sympy.sympify(text, locals=shape_symbols(text)),
}


def parse_program(text: str) -> Program:
    """The Program `text` describes (the inverse of `format_program`)."""
    return _Parser(text).parse()


class _Cursor:
    """A position in one line, with the readers of the value syntax."""

    def __init__(self, text: str, line_no: int, start: int = 0):
        self.text, self.line_no, self.pos = text, line_no, start

    def error(self, expected: str) -> ProgramParseError:
        rest = self.text[self.pos:]
        found = repr(rest[:30] + ("…" if len(rest) > 30 else "")) if rest else "the end of the line"
        return ProgramParseError(f"line {self.line_no}, column {self.pos + 1}: expected {expected}, found {found}\n"
                                 f"    {self.text}")

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self, s: str) -> bool:
        return self.text.startswith(s, self.pos)

    def eat(self, s: str) -> bool:
        if self.peek(s):
            self.pos += len(s)
            return True
        return False

    def expect(self, s: str, what: str | None = None) -> None:
        if not self.eat(s):
            raise self.error(what or repr(s))

    def match(self, pattern: re.Pattern) -> re.Match | None:
        found = pattern.match(self.text, self.pos)
        if found:
            self.pos = found.end()
        return found

    def skip_spaces(self) -> None:
        while self.peek(" "):
            self.pos += 1

    def string(self) -> str:
        found = self.match(STRING)
        if not found:
            raise self.error("a quoted string")
        return ast.literal_eval(found.group())

    def name(self, what: str = "a Var name") -> str:
        """A bare name or a quoted `%'…'` one."""
        if self.eat("%"):
            return self.string()
        found = self.match(NAME)
        if not found:
            raise self.error(what)
        return found.group()

    def key(self) -> Any:
        if self.peek("'") or self.peek('"'):
            return self.string()
        found = self.match(KEY)
        if not found:
            raise self.error("a key")
        return found.group()

    def sequence(self, close: str, item: Callable[[], Any], what: str) -> list:
        """Items separated by `, ` up to `close`; returns them and leaves the cursor after `close`."""
        items: list = []
        while not self.eat(close):
            if items:
                self.expect(", ", f"', ' or {close!r} in {what}")
            items.append(item())
        return items

    def value(self) -> Any:
        if self.eat("["):
            return self.sequence("]", self.value, "a list")
        if self.eat("("):
            return self._tuple()
        if self.eat("{"):
            return dict(self.sequence("}", self._dict_item, "a dict"))
        if self.peek("'") or self.peek('"'):
            return self.string()
        if self.eat("%"):
            return Ref(self.string())
        if self.peek("<"):
            raise self.error("a value (values printed as <type …> have no text form)")
        number = self.peek("-") or self.text[self.pos:self.pos + 1].isdigit()
        number = number and (self.match(FLOAT) or self.match(INT))
        if number:
            if self.match(NAME):
                raise self.error("a number")
            text = number.group()
            return int(text) if INT.fullmatch(text) else float(text)
        word = self.name("a value: a Var name, number, string, list, tuple, dict, dtype or constant")
        if word in _CONSTANTS:
            return _CONSTANTS[word]
        if word in DTYPES:
            return DTYPES[word]
        if word.startswith("torch."):
            constant = getattr(torch, word.removeprefix("torch."), None)
            if not isinstance(constant, (torch.dtype, *TORCH_CONSTANTS)):
                raise self.error("a torch dtype, layout or memory format after 'torch.'")
            return constant
        if word in _CONSTRUCTORS and self.eat("("):
            argument = self.string()
            self.expect(")")
            return _CONSTRUCTORS[word](argument)
        return Ref(word)

    def _tuple(self) -> tuple:
        """After '(': `()`, `(x,)`, `(x, y)`."""
        if self.eat(")"):
            return ()
        items = [self.value()]
        while not self.eat(")"):
            self.expect(",", "',' or ')' in a tuple")
            if self.eat(")"):
                return tuple(items)
            self.expect(" ", "' ' after ','")
            items.append(self.value())
        if len(items) == 1:
            raise self.error("a tuple of one written (x,)")
        return tuple(items)

    def _dict_item(self) -> tuple[Any, Any]:
        key = self.value()
        self.expect(": ", "': ' after a dict key")
        return key, self.value()

    def keyword(self) -> tuple[Any, Any]:
        key = self.key()
        self.expect("=", "'=' after a keyword")
        return key, self.value()


@dataclass
class _Pending:
    """Header facts checked once the whole text is read."""

    header_line: int = 0
    ops: int = 0
    blocks: int = 0
    feeds: list[tuple[str, str | None]] = field(default_factory=list)
    feeds_line: int = 0


class _Parser:
    def __init__(self, text: str):
        self.lines = [(i, line) for i, line in enumerate(text.splitlines(), 1)
                      if line.strip() and not line.lstrip().startswith(("#", "//"))]
        self.at = 0
        self.program = Program(blocks=[], metadata={})
        self.blocks: dict[int, Block] = {}
        self.block_lines: dict[int, int] = {}
        self.default_device = "cpu"
        self.sources: dict[str, str] = {}
        self.pending = _Pending()
        self.raw = ""  # the line last read

    def error(self, line_no: int, message: str) -> ProgramParseError:
        return ProgramParseError(f"line {line_no}: {message}")

    def next_line(self, expected: str) -> tuple[int, str]:
        if self.at >= len(self.lines):
            last = self.lines[-1][0] if self.lines else 0
            raise self.error(last + 1, f"expected {expected}, found the end of the text")
        line_no, line = self.lines[self.at]
        self.at += 1
        self.raw = line.rstrip()
        return line_no, line.strip()

    def cursor(self, line_no: int, offset: int = 0) -> _Cursor:
        """A cursor on the line just read, `offset` characters after its indentation (columns count from 1)."""
        return _Cursor(self.raw, line_no, len(self.raw) - len(self.raw.lstrip()) + offset)

    # ----- structure

    def parse(self) -> Program:
        self._header()
        while self.at < len(self.lines):
            line_no, line = self.next_line("a block")
            found = _BLOCK.fullmatch(line)
            if not found:
                raise self.error(line_no, f"expected 'block N {{' or 'block N (parent P) {{', found {line!r}")
            self._block(line_no, found)
        self._check()
        return self.program

    def _header(self) -> None:
        line_no, line = self.next_line("the header 'program KIND: N ops, M block(s)'")
        found = _HEADER.fullmatch(line)
        if not found:
            raise self.error(line_no, f"expected the header 'program KIND: N ops, M block(s)', found {line!r}")
        if found.group(1):
            self.program.metadata["kind"] = found.group(1)
        self.pending.header_line, self.pending.ops, self.pending.blocks = line_no, int(found[2]), int(found[3])
        readers = {"device: ": self._device, "sources: ": self._sources, "feeds: ": self._feeds,
                   "fetches: ": self._fetches, "meta ": self._meta}
        while self.at < len(self.lines) and not self.lines[self.at][1].startswith("block "):
            line_no, line = self.next_line("a header line")
            prefix = next((p for p in readers if line.startswith(p)), None)
            if prefix is None:
                raise self.error(line_no, f"expected a header line ({', '.join(p.strip() for p in readers)}) "
                                          f"or 'block 0 {{', found {line!r}")
            readers[prefix](self.cursor(line_no, len(prefix)))

    def _device(self, cursor: _Cursor) -> None:
        self.default_device = cursor.text[cursor.pos:]

    def _sources(self, cursor: _Cursor) -> None:
        def path() -> str:
            if cursor.peek("'") or cursor.peek('"'):
                return cursor.string()
            found = cursor.match(re.compile(r"[^\s,'\"]+"))
            if not found:
                raise cursor.error("a source file path")
            return found.group()

        paths = [path()]
        while cursor.eat(", "):
            paths.append(path())
        self._end(cursor)
        self.sources = {os.path.basename(p): p for p in paths}

    def _feeds(self, cursor: _Cursor) -> None:
        self.pending.feeds_line = cursor.line_no
        if cursor.eat("-"):
            return self._end(cursor)
        while True:
            name = cursor.name()
            type_text = None
            if cursor.eat(": "):
                found = cursor.match(TYPE)
                if not found:
                    raise cursor.error("a type such as f32[8,16]")
                type_text = found.group()
            self.pending.feeds.append((name, type_text))
            if not cursor.eat(", "):
                return self._end(cursor)

    def _fetches(self, cursor: _Cursor) -> None:
        if cursor.eat("-"):
            return self._end(cursor)
        while True:
            key = cursor.key()
            cursor.expect("=", "'=' after a fetch key")
            self.program.fetches[key] = cursor.name()
            if not cursor.eat(", "):
                return self._end(cursor)

    def _meta(self, cursor: _Cursor) -> None:
        key = cursor.key()
        cursor.expect(" = ", "' = ' after the metadata key")
        self.program.metadata[key] = cursor.value()
        self._end(cursor)

    def _end(self, cursor: _Cursor) -> None:
        if not cursor.at_end():
            raise cursor.error("the end of the line")

    def _block(self, line_no: int, found: re.Match) -> Block:
        idx = int(found.group(1))
        parent = int(found.group(2)) if found.group(2) is not None else -1
        if idx in self.blocks:
            raise self.error(line_no, f"block {idx} appears twice (first at line {self.block_lines[idx]})")
        block = self.blocks[idx] = Block(idx, parent)
        self.block_lines[idx] = line_no
        last_op: Op | None = None
        while True:
            line_no, line = self.next_line(f"an op, a declaration or '}}' closing block {idx}")
            if line == "}":
                return block
            nested = _BLOCK.fullmatch(line)
            if nested:
                if last_op is None:
                    raise self.error(line_no, f"expected an op before nested block {nested.group(1)}: "
                                              "a sub-block follows the op that runs it")
                if "sub_block" in last_op.attrs:
                    raise self.error(line_no, f"op {last_op.name!r} already names sub-block "
                                              f"{last_op.attrs['sub_block']}")
                last_op.attrs["sub_block"] = self._block(line_no, nested).idx
                last_op = None
                continue
            first = line.split(" ", 1)[0]
            if first in _KINDS and not line.startswith(first + ":"):
                self._declaration(self.cursor(line_no, len(first) + 1), block, _KINDS[first])
                last_op = None
            else:
                last_op = self._op(self.cursor(line_no), block)
                block.ops.append(last_op)

    def _declaration(self, cursor: _Cursor, block: Block, kind: VarKind) -> None:
        start = cursor.pos
        name = cursor.name()
        if name in block.vars:
            cursor.pos = start
            raise cursor.error(f"a Var not declared before in block {block.idx} ({name!r} is)")
        cursor.expect(": ", "': ' and a type after the Var name")
        found = cursor.match(TYPE)
        if not found or found.group(3):
            raise cursor.error("a type such as f32[8,16] (the device follows after a space)")
        shape, dtype = self._type(cursor, found)
        cursor.expect(" ", "' ' and a device after the type")
        device = cursor.text[cursor.pos:]
        if not device or " " in device:
            raise cursor.error("a device such as cpu or cuda:0")
        block.add_var(Var(name, shape, dtype, device, kind))

    def _type(self, cursor: _Cursor, found: re.Match) -> tuple[tuple | None, str]:
        dtype = DTYPE_LONG.get(found.group(1), found.group(1))  # not only torch dtypes: `work` is a collective handle
        dims = found.group(2)
        if dims is None:
            return None, dtype
        shape = []
        for dim in _split_dims(dims):
            try:
                shape.append(int(dim) if INT.fullmatch(dim) else sympy.sympify(dim, locals=shape_symbols(dim)))
            except (sympy.SympifyError, SyntaxError, TypeError) as exc:
                raise cursor.error(f"a dimension (an int or a shape expression) in {found.group()!r}") from exc
        return tuple(shape), dtype

    # ----- op lines

    def _op(self, cursor: _Cursor, block: Block) -> Op:
        outputs = self._outputs(cursor, block)
        found = cursor.match(re.compile(r"[\w.]+"))
        if not found:
            raise cursor.error("an op type such as aten.mm.default")
        op_type = found.group()
        cursor.expect("(", f"'(' after the op type {op_type}")
        args: list = []
        kwargs: dict = {}

        def argument() -> None:
            if kwargs or _KEYWORD.match(cursor.text, cursor.pos):  # positional arguments come first
                key, value = cursor.keyword()
                kwargs[key] = value
            else:
                args.append(cursor.value())

        cursor.sequence(")", argument, f"the arguments of {op_type}")
        attrs: dict = {}
        if cursor.eat(" {"):
            attrs = dict(cursor.sequence("}", cursor.keyword, "the attributes"))
        cursor.skip_spaces()
        cursor.expect("# ", "'  # ' and the op's notes (its role at least)")
        name, notes = self._notes(cursor, outputs)
        notes.update(attrs)
        return Op(name, op_type, tuple(args), kwargs, [o for o, _ in outputs], notes)

    def _outputs(self, cursor: _Cursor, block: Block) -> list[tuple[str | None, Any]]:
        """(name, Var) per output; creates the temporaries the line introduces."""
        if cursor.eat("() = "):
            return []
        outputs = []
        while True:
            quoted = cursor.peek("%")
            name = cursor.name("an output: a Var name, `_` or `()`")
            if name == "_" and not quoted:
                outputs.append((None, None))
            elif cursor.eat(": "):
                outputs.append((name, self._typed_output(cursor, block, name)))
            else:
                outputs.append((name, self._resolve(name, block)))
            if cursor.eat(" = "):
                return outputs
            cursor.expect(", ", "', ' or ' = ' after an output")

    def _typed_output(self, cursor: _Cursor, block: Block, name: str) -> Var:
        start = cursor.pos
        found = cursor.match(TYPE)
        if not found:
            raise cursor.error("a type such as f32[8,16]")
        shape, dtype = self._type(cursor, found)
        var = Var(name, shape, dtype, found.group(3) or self.default_device)
        existing = self._resolve(name, block)
        if existing is None:
            return block.add_var(var)
        if (existing.shape, existing.dtype, existing.device) != (var.shape, var.dtype, var.device):
            cursor.pos = start
            raise cursor.error(f"the type of {existing.kind.value} Var {name!r} "
                               f"({existing.dtype}{list(existing.shape) if existing.shape is not None else ''} "
                               f"on {existing.device})")
        return existing

    def _resolve(self, name: str, block: Block) -> Var | None:
        seen = set()
        current: Block | None = block
        while current is not None and current.idx not in seen:
            seen.add(current.idx)
            if name in current.vars:
                return current.vars[name]
            current = self.blocks.get(current.parent_idx)
        return None

    def _notes(self, cursor: _Cursor, outputs: list) -> tuple[str, dict]:
        """The op's name and the standard attrs its notes give (`# role  module  key=value  file:line`)."""
        tokens = NOTE_TOKEN.findall(cursor.text, cursor.pos)
        if not tokens:
            raise cursor.error("the op's role (forward, backward|loss, …, or -)")
        attrs: dict = {}
        if tokens[0] != ABSENT:
            try:
                attrs["op_role"] = int(OpRole.parse(tokens[0]))
            except KeyError:
                raise cursor.error(f"a role made of {', '.join(r.name.lower() for r in OpRole)} or none, "
                                   "joined by '|', or -") from None
        given: dict[str, str | None] = {}
        for token in tokens[1:]:
            found = _NOTE_KV.fullmatch(token)
            if found and found.group(1) in _NOTE_FIELDS:
                key, text = found.groups()
                value = ast.literal_eval(text) if text[:1] in ("'", '"') else text
            elif found:
                raise cursor.error(f"a note key among {', '.join(_NOTE_FIELDS)}, not {found.group(1)!r} "
                                   "(other attributes go in braces before the '#')")
            elif SOURCE_NOTE.fullmatch(token):
                path, _, line = token.rpartition(":")
                key, value = "source", f"{self.sources.get(path, path)}:{line}"
            else:
                key, value = "module_path", None if token == ABSENT else token
            if key in given:
                raise cursor.error(f"one {key} note (a second one: {token!r})")
            given[key] = value
        module = given.pop("module_path", "")
        if module is not None:
            attrs["module_path"] = module
        name = given.pop("name", None)
        if name is None:
            if not outputs or outputs[0][0] is None:
                raise cursor.error("a name=… note: the op has no first output to name it after")
            name = outputs[0][0]
        attrs.update(given)
        return name, attrs

    # ----- checks once everything is read

    def _check(self) -> None:
        pending = self.pending
        missing = sorted(set(range(len(self.blocks))) - set(self.blocks))
        if missing or len(self.blocks) != pending.blocks:
            raise self.error(pending.header_line, f"the header says {pending.blocks} block(s); the text has "
                                                  f"blocks {sorted(self.blocks)}")
        self.program.blocks = [self.blocks[i] for i in range(len(self.blocks))]
        if self.program.num_ops() != pending.ops:
            raise self.error(pending.header_line, f"the header says {pending.ops} ops; the text has "
                                                  f"{self.program.num_ops()}")
        for name, type_text in pending.feeds:
            var = self.program.find_var(name)
            if (var is None) != (type_text is None) or (var is not None and not _same_type(var, type_text)):
                raise self.error(pending.feeds_line, f"feed {name!r} does not match its declaration in block 0 "
                                                     f"(declared: {var})")
            self.program.feeds.append(name)


def _same_type(var: Var, type_text: str) -> bool:
    from_text = TYPE.fullmatch(type_text)
    dims = None if from_text.group(2) is None else _split_dims(from_text.group(2))
    shown = None if var.shape is None else [str(d) for d in var.shape]
    return DTYPE_LONG.get(from_text.group(1), from_text.group(1)) == var.dtype and dims == shown


def _split_dims(text: str) -> list[str]:
    """`8,Max(s0, 2)` → ['8', 'Max(s0, 2)']: commas inside parentheses belong to an expression."""
    if text == "":
        return []
    dims, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            dims.append(text[start:i])
            start = i + 1
    dims.append(text[start:])
    return dims

"""A Program as collapsible HTML: ops grouped by module path, sub-blocks nested, coloured by role."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fleetc.ir.printer import format_type, role_counts
from fleetc.ir.program import Program
from fleetc.viz.changes import (
    ADDED,
    CHANGED,
    REMOVED,
    SAME,
    OpEntry,
    ProgramChanges,
    compare_programs,
)
from fleetc.viz.style import esc, fusion_marks, legend, primary_role, wrap

# Programs up to this many ops open every module group; larger ones open only groups with changes.
OPEN_ALL_UP_TO = 80
TOP_LEVEL = "(model top level)"


@dataclass
class _ModuleNode:
    """Ops whose module path is exactly `path`, and the sub-modules below it."""

    path: str
    entries: list[OpEntry] = field(default_factory=list)
    children: dict[str, "_ModuleNode"] = field(default_factory=dict)

    def walk_entries(self):
        yield from self.entries
        for child in self.children.values():
            yield from child.walk_entries()


def _module_tree(entries: list[OpEntry]) -> _ModuleNode:
    root = _ModuleNode("")
    for entry in entries:
        node, prefix = root, []
        for part in entry.op.module_path.split(".") if entry.op.module_path else []:
            prefix.append(part)
            node = node.children.setdefault(part, _ModuleNode(".".join(prefix)))
        node.entries.append(entry)
    return root


def _op_html(entry: OpEntry, changes: ProgramChanges, open_all: bool) -> str:
    op = entry.op
    classes = ["op", f"r-{primary_role(op)}"] + ([entry.status] if entry.status != SAME else [])
    badges = [f'<span class="badge fused">{esc(m)}</span>' for m in fusion_marks(op)]
    if entry.status != SAME:
        badges.append(f'<span class="badge {entry.status}">{entry.status}</span>')
    index = f"#{entry.index}" if entry.index is not None else "—"
    html = (f'<div class="{" ".join(classes)}" data-op="{esc(op.name)}"><span class="idx">{index}</span>'
            f'{esc(entry.line)}{"".join(badges)}</div>')
    if entry.status == CHANGED:
        html += f'<div class="op was"><span class="idx">was</span>{esc(entry.before_line)}</div>'
    if op.sub_block is not None and entry.status != REMOVED:
        sub = entry.program.blocks[op.sub_block]
        html += (f'<details class="subblock" open><summary>block {sub.idx} (parent {sub.parent_idx}): '
                 f'{len(sub.ops)} ops</summary>{_block_html(changes, sub.idx, open_all)}</details>')
    return html


def _group_summary(node: _ModuleNode, label: str) -> tuple[str, bool]:
    entries = list(node.walk_entries())
    roles = Counter(primary_role(e.op) for e in entries if e.status != REMOVED)
    statuses = Counter(e.status for e in entries)
    live = len(entries) - statuses[REMOVED]
    role_text = ", ".join(f"{n} {role}" for role, n in roles.most_common())
    change_text = " ".join(f'<span class="badge {s}">{statuses[s]} {s}</span>'
                           for s in (ADDED, REMOVED, CHANGED) if statuses[s])
    summary = f'<b>{esc(label)}</b> <span class="count">{live} ops: {role_text}</span> {change_text}'
    return summary, any(s != SAME for s in statuses)


def _node_html(node: _ModuleNode, label: str, changes: ProgramChanges, open_all: bool) -> str:
    summary, has_changes = _group_summary(node, label)
    body = "".join(_op_html(e, changes, open_all) for e in node.entries)
    body += "".join(_node_html(child, child.path, changes, open_all) for child in node.children.values())
    state = " open" if open_all or has_changes else ""
    return f'<details class="module"{state}><summary>{summary}</summary>{body}</details>'


def _block_html(changes: ProgramChanges, block_idx: int, open_all: bool) -> str:
    root = _module_tree(changes.blocks[block_idx])
    html = ""
    if root.entries:
        html += _node_html(_ModuleNode("", root.entries), TOP_LEVEL, changes, open_all)
    return html + "".join(_node_html(c, c.path, changes, open_all) for c in root.children.values())


def program_body(program: Program, before: Program | None = None) -> str:
    """The Program's header and module groups, without the stylesheet; ops changed vs `before` highlighted."""
    changes = compare_programs(program, before)
    kind = program.metadata.get("kind", "program")
    roles = ", ".join(f"{n} {role}" for role, n in role_counts(program).items())
    feeds = ", ".join(f"{n}: {format_type(program.var(n))}" for n in program.feeds) or "-"
    fetches = ", ".join(f"{k}={v}" for k, v in program.fetches.items()) or "-"
    head = (f'<div><b>program {esc(kind)}</b>: {program.num_ops()} ops in {len(program.blocks)} block(s) '
            f'({esc(roles)})</div><div>feeds: <code>{esc(feeds)}</code></div>'
            f'<div>fetches: <code>{esc(fetches)}</code></div>')
    if before is not None:
        head += f'<div>against the Program before: {esc(changes.summary())}</div>'
    open_all = program.num_ops() <= OPEN_ALL_UP_TO
    return f'{head}{legend()}<div class="program">{_block_html(changes, 0, open_all)}</div>'


def program_html(program: Program, before: Program | None = None) -> str:
    """A notebook view of a Program (Program._repr_html_); pass `before` to highlight what changed."""
    return wrap(program_body(program, before))

"""What every inspection view shares: the stylesheet, op role colours, fused-op marks and byte formatting."""
from __future__ import annotations

import html

from fleetc.ir.program import Op, OpRole

# The role an op is coloured by when it has several (e.g. `backward|loss` shows as backward).
_ROLE_PRIORITY = (OpRole.COLLECTIVE, OpRole.OPTIMIZE, OpRole.LR_SCHED, OpRole.BACKWARD, OpRole.LOSS,
                  OpRole.FORWARD)

ROLE_COLOURS = {
    "forward": "#dbeafe", "loss": "#ede9fe", "backward": "#ffedd5", "optimize": "#dcfce7",
    "lr_sched": "#ccfbf1", "collective": "#fee2e2", "none": "#f3f4f6",
}
ROLE_BORDERS = {
    "forward": "#2563eb", "loss": "#7c3aed", "backward": "#ea580c", "optimize": "#16a34a",
    "lr_sched": "#0d9488", "collective": "#dc2626", "none": "#9ca3af",
}

_ROLE_RULES = "\n".join(
    f".fleetc .r-{role} {{ background: {ROLE_COLOURS[role]}; border-left: 4px solid {ROLE_BORDERS[role]}; }}"
    for role in ROLE_COLOURS)

CSS = """
.fleetc { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; font-size: 13px; color: #111827; }
.fleetc h2, .fleetc h3 { margin: 12px 0 6px; }
.fleetc code, .fleetc pre, .fleetc .op { font-family: ui-monospace, 'DejaVu Sans Mono', Menlo, monospace;
  font-size: 12px; }
.fleetc table.facts, .fleetc table.passes { border-collapse: collapse; margin: 4px 0 8px; }
.fleetc table.facts td, .fleetc table.facts th, .fleetc table.passes td, .fleetc table.passes th {
  border: 1px solid #e5e7eb; padding: 2px 8px; text-align: left; vertical-align: top; }
.fleetc th { background: #f9fafb; }
.fleetc details { margin: 2px 0 2px 14px; }
.fleetc summary { cursor: pointer; }
.fleetc .module > summary b { font-family: ui-monospace, 'DejaVu Sans Mono', monospace; }
.fleetc .count { color: #6b7280; }
.fleetc .op { white-space: pre-wrap; overflow-wrap: anywhere; padding: 1px 6px; margin: 1px 0 1px 14px; }
.fleetc .idx { color: #6b7280; display: inline-block; min-width: 3.5em; }
.fleetc .added { outline: 2px solid #16a34a; }
.fleetc .removed { outline: 2px solid #dc2626; text-decoration: line-through; opacity: 0.75; }
.fleetc .changed { outline: 2px dashed #ca8a04; }
.fleetc .was { color: #92400e; }
.fleetc .badge { display: inline-block; border-radius: 8px; padding: 0 6px; margin-left: 6px; font-size: 11px;
  font-family: system-ui, sans-serif; background: #e5e7eb; }
.fleetc .badge.fused { background: #fde68a; }
.fleetc .badge.added { background: #bbf7d0; outline: none; }
.fleetc .badge.removed { background: #fecaca; outline: none; text-decoration: none; opacity: 1; }
.fleetc .badge.changed { background: #fef08a; outline: none; }
.fleetc .legend span { display: inline-block; padding: 0 6px; margin-right: 4px; }
.fleetc pre.diff { background: #f9fafb; padding: 6px; overflow-x: auto; }
.fleetc pre.diff .add { background: #dcfce7; } .fleetc pre.diff .del { background: #fee2e2; }
.fleetc pre.diff .hunk { color: #6d28d9; } .fleetc pre.diff .file { font-weight: bold; }
.fleetc .scroll { max-height: 640px; overflow: auto; border: 1px solid #e5e7eb; }
.fleetc .note { color: #6b7280; font-style: italic; }
""" + _ROLE_RULES


def esc(value: object) -> str:
    """Text made safe to place inside HTML elements and attributes."""
    return html.escape(str(value), quote=True)


def primary_role(op: Op) -> str:
    """The role label an op is coloured by: the most specific of its roles."""
    role = op.role
    for candidate in _ROLE_PRIORITY:
        if candidate in role:
            return OpRole(candidate).label()
    return "none"


def fusion_marks(op: Op) -> list[str]:
    """Badges for ops a pass made: `fused` for fused op types, `by <pass>` for any provenance."""
    marks = ["fused"] if op.type.startswith("fleetc.fused") else []
    if op.attrs.get("provenance"):
        marks.append(f"by {op.attrs['provenance']}")
    return marks


def format_bytes(n: int) -> str:
    """`512 B`, `12.00 KiB`, `1.25 MiB`, `2.00 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def legend() -> str:
    """One coloured chip per role, then the change and fusion marks."""
    chips = "".join(f'<span class="r-{role}">{role}</span>' for role in ROLE_COLOURS if role != "none")
    marks = ('<span class="added">added</span><span class="removed">removed</span>'
             '<span class="changed">changed</span><span class="badge fused">fused</span>')
    return f'<div class="legend">{chips} {marks}</div>'


def wrap(body: str) -> str:
    """A notebook output: the stylesheet scoped to one `.fleetc` element around `body`."""
    return f'<div class="fleetc"><style>{CSS}</style>{body}</div>'

"""A small SVG chart of the estimated live bytes after each op, with the peak marked."""
from __future__ import annotations

from fleetc.ir.liveness import MemoryEstimate
from fleetc.viz.style import esc, format_bytes

WIDTH, HEIGHT, PAD = 640, 90, 4


def memory_chart(memory: MemoryEstimate) -> str:
    """Inline SVG (no script); empty when the Program has no ops."""
    timeline = memory.live_after_op
    if not timeline:
        return ""
    low = min(b for _, b in timeline)
    span = max(memory.peak_bytes - low, 1)
    step = (WIDTH - 2 * PAD) / max(len(timeline) - 1, 1)

    def point(i: int, live: int) -> tuple[float, float]:
        return PAD + i * step, HEIGHT - PAD - (live - low) / span * (HEIGHT - 2 * PAD)

    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (point(i, b) for i, (_, b) in enumerate(timeline)))
    peak_i = next((i for i, (name, _) in enumerate(timeline) if name == memory.peak_op), 0)
    px, py = point(peak_i, memory.peak_bytes)
    caption = (f"estimated live bytes after each op: {format_bytes(low)} … peak {format_bytes(memory.peak_bytes)}"
               f" after op {memory.peak_op or '-'}")
    return (f'<div class="memory"><div class="count">{esc(caption)}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">'
            f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#f9fafb" stroke="#e5e7eb"/>'
            f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{points}"/>'
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="#dc2626"><title>{esc(caption)}</title></circle>'
            f'</svg></div>')

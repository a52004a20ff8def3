"""The pipeline schedule as a picture: an SVG timeline, one row per rank, one box per forward/backward action."""
from __future__ import annotations

from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.schedule import build_schedule
from fleetc.passes.pipeline_parallel.simulate import simulate
from fleetc.viz.style import esc

WIDTH, ROW, PAD, LABEL = 640, 22, 4, 52
COLORS = {"forward": "#93c5fd", "backward": "#86efac", "backward_input": "#86efac", "backward_weight": "#fdba74"}


def pipeline_timeline(program: Program) -> str:
    """Inline SVG (no script) of the simulated schedule of a Program the pipeline pass planned; empty otherwise."""
    meta = program.metadata.get("pipeline")
    if not meta:
        return ""
    schedule = build_schedule(meta["schedule_mode"], meta["stages"] // meta["vpp_degree"], meta["microbatches"],
                              meta["vpp_degree"])
    sim = simulate(schedule)
    scale = (WIDTH - LABEL - 2 * PAD) / sim.makespan
    height = schedule.ranks * ROW + 2 * PAD
    boxes = []
    for rank in range(schedule.ranks):
        y = PAD + rank * ROW
        boxes.append(f'<text x="{PAD}" y="{y + ROW * 0.7:.1f}" font-size="11">rank {rank}</text>')
    for slot in sim.timeline:
        x, y = LABEL + PAD + slot.start * scale, PAD + slot.rank * ROW + 2
        w = (slot.end - slot.start) * scale
        boxes.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w - 1, 1):.1f}" height="{ROW - 4}" '
                     f'fill="{COLORS[slot.action.kind]}" stroke="#475569" stroke-width="0.5">'
                     f'<title>{esc(str(slot.action))}</title></rect>'
                     f'<text x="{x + w / 2:.1f}" y="{y + ROW * 0.6:.1f}" font-size="9" '
                     f'text-anchor="middle">{slot.action.microbatch}</text>')
    caption = (f"pipeline timeline ({schedule.mode}, simulated with uniform costs): {schedule.ranks} rank(s) × "
               f"{sim.makespan:g} time units, bubble fraction {sim.bubble_fraction:.1%}; blue forward, green "
               "backward (input gradient), orange weight gradient; numbers are micro-batches")
    return (f'<div class="memory"><div class="count">{esc(caption)}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img">'
            f'<rect width="{WIDTH}" height="{height}" fill="#f9fafb" stroke="#e5e7eb"/>{"".join(boxes)}</svg></div>')

"""Pass-by-pass inspection: HTML views for notebooks and reports, graph pictures, per-pass dump files.

Importing it registers the notebook views of Program, PassRecord, History and diffs with `fleetc.ir.html`,
so the IR and the pass manager render as HTML without importing this package (`import fleetc` does it).
"""
from fleetc.ir.html import register_html_view
from fleetc.ir.program import Program
from fleetc.passes.manager import History, PassRecord, UnifiedDiff
from fleetc.viz.diff_view import diff_html
from fleetc.viz.graph import GraphPicture, program_graph
from fleetc.viz.program_view import program_html
from fleetc.viz.record_view import history_html, record_html
from fleetc.viz.report import report_html

register_html_view(Program, program_html)
register_html_view(PassRecord, record_html)
register_html_view(History, history_html)
register_html_view(UnifiedDiff, diff_html)

__all__ = ["GraphPicture", "UnifiedDiff", "diff_html", "history_html", "program_graph", "program_html",
           "record_html", "report_html"]

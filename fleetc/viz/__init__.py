"""Pass-by-pass inspection: HTML views for notebooks and reports, graph pictures, per-pass dump files, progress."""
from fleetc.viz.diff_view import UnifiedDiff
from fleetc.viz.graph import GraphPicture, program_graph
from fleetc.viz.program_view import program_html
from fleetc.viz.record_view import history_html, record_html
from fleetc.viz.report import report_html

__all__ = ["GraphPicture", "UnifiedDiff", "history_html", "program_graph", "program_html", "record_html",
           "report_html"]

"""A progress bar over the stages of one compile (capture, each pass, codegen), shown only when it is slow.

tqdm draws it in terminals and notebooks; it appears once compiling has taken `delay` seconds, so quick
compiles print nothing, and never when standard error is a file or pipe (logs, CI, captured output)
outside a notebook. `TQDM_DISABLE=1` in the environment turns it off everywhere. Any long step inside a compile
(e.g. kernel generation) announces itself with `progress_stage("kernel generation")`.
"""
from __future__ import annotations

import contextvars
import sys
import threading
import warnings
from typing import IO

from fleetc.ir.program import Program
from fleetc.passes.instruments import PassInstrument

DEFAULT_DELAY = 2.0  # seconds before the bar appears
REFRESH_SECONDS = 1.0  # a long stage (e.g. capture of a large model) still shows its elapsed time

_active: contextvars.ContextVar[CompileProgress | None] = contextvars.ContextVar("fleetc_progress", default=None)


def wanted(file: IO[str] | None) -> bool:
    """Show a bar on a terminal, or in a Jupyter kernel (whose streams are not terminals but render it)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and "IPKernelApp" in shell.config:
        return True
    stream = file or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def _tqdm_class():
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        # Without ipywidgets, tqdm.auto warns and uses its text bar, which notebooks show fine.
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm


class CompileProgress:
    """Context manager: while open, `progress_stage(name)` marks the previous stage done and shows `name`."""

    def __init__(self, description: str, delay: float | None = None, file: IO[str] | None = None):
        self.description = description
        self.delay = DEFAULT_DELAY if delay is None else delay
        self.file = file
        self.stages: list[str] = []
        self._bar = None
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> CompileProgress:
        self._token = _active.set(self)
        if wanted(self.file):
            self._bar = _tqdm_class()(desc=self.description, unit="stage", delay=self.delay, file=self.file,
                                      mininterval=0,  # a handful of stages: draw each one
                                      bar_format="{desc}: {n_fmt} stages done [{elapsed}]{postfix}")
            self._refresher = threading.Thread(target=self._refresh_while_open, daemon=True)
            self._refresher.start()
        return self

    def _refresh_while_open(self) -> None:
        if self._closed.wait(self.delay):
            return
        while not self._closed.is_set():
            self._bar.update(0)  # redraws; unlike refresh() it records the print, so close() ends the line
            self._closed.wait(REFRESH_SECONDS)

    def _show(self, text: str, done: int) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(done)

    def stage(self, name: str) -> None:
        self._show(name, 1 if self.stages else 0)
        self.stages.append(name)

    def __exit__(self, *exc_info: object) -> None:
        _active.reset(self._token)
        if self._bar is None:
            return
        self._closed.set()
        self._refresher.join(timeout=REFRESH_SECONDS * 5)
        self._show("done" if exc_info[0] is None else f"failed in {self.stages[-1] if self.stages else '-'}",
                   1 if self.stages else 0)
        self._bar.close()


def progress_stage(name: str) -> None:
    """Announce the stage starting now to the open CompileProgress, if any (no-op outside a compile)."""
    progress = _active.get()
    if progress is not None:
        progress.stage(name)


class ProgressInstrument(PassInstrument):
    """Announces each pass as a stage of the open CompileProgress."""

    def before_pass(self, name: str, program: Program) -> None:
        progress_stage(name)

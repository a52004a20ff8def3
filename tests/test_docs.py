"""The Python snippets of README.md and docs/*.md run: each page's ```python blocks, in order, in one namespace.

A block fenced ```python no-run is shown but not run (it needs torchrun, a GPU, or a second process); the example
scripts and multi-process tests run those paths instead. Pages run in a temporary directory, so files they write
stay out of the repository.
"""
from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python( no-run)?\n(.*?)^```$", re.S | re.M)


def snippets(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, source) of every block of `page` that runs."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text) if not m.group(1)]


def test_every_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert all(f"docs/{page.name}" in readme for page in PAGES[1:])


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)], ids=lambda p: p.name)
def test_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, source in snippets(page):
        code = compile("\n" * (line - 1) + source, str(page), "exec")  # tracebacks point at the page's lines
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)

"""The GPT zoo model's `dump-ir --format html` report, opened in headless Chromium: every pass shows.

.ci/run installs Debian's `chromium`; the test skips only when no Chromium is installed or it cannot start.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fleetc.cli import main
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_conflicts, resolve_strategy

WINDOW = (1280, 2000)
TIMEOUT_S = 120


def _chromium() -> str:
    binary = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                   if (path := shutil.which(name))), None)
    if binary is None:
        pytest.skip("no Chromium installed (.ci/run installs Debian's chromium package)")
    try:
        probe = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{binary} cannot run: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"{binary} --version exited {probe.returncode}: {probe.stderr.strip()[-300:]}")
    return binary


def _headless(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)


class _VisibleText(HTMLParser):
    """Text outside <style>, and separately the text of headings and table cells (always unfolded)."""

    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.text, self.headings = [], []

    def handle_starttag(self, tag, attrs):
        self.open.append(tag)

    def handle_endtag(self, tag):
        while self.open and self.open.pop() != tag:
            pass

    def handle_data(self, data):
        if "style" not in self.open:
            self.text.append(data)
            if {"h3", "td"} & set(self.open) and "details" not in self.open:
                self.headings.append(data)


def _png_size_and_colours(png: bytes) -> tuple[int, int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    pixels, pos = b"", 8
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IDAT":
            pixels += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(pixels)
    return width, height, len(set(raw[i:i + 3] for i in range(1, len(raw) - 3, 997)))


@pytest.mark.slow
def test_gpt_report_opens_in_chromium_and_shows_every_pass(tmp_path, capsys) -> None:
    binary = _chromium()
    report = tmp_path / "report.html"
    assert main(["dump-ir", "cli_factories:gpt", "--format", "html", "--out", str(report)]) == 0
    assert capsys.readouterr().err == ""
    passes = ["capture", *(p.name for p in ordered_passes(resolve_conflicts(resolve_strategy(None))[0]))]

    dom = _headless(binary, tmp_path / "profile", "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _VisibleText()
    page.feed(dom.stdout)
    text = " ".join(page.text)
    assert "fleetc dump-ir cli_factories:gpt" in text
    for i, name in enumerate(passes):
        assert f"#{i} {name}" in " ".join(page.headings)  # a visible section heading per pass
    assert "layers.0.attn" in text and "aten.native_layer_norm.default" in text

    shot = tmp_path / "report.png"
    run = _headless(binary, tmp_path / "profile", f"--screenshot={shot}",
                    f"--window-size={WINDOW[0]},{WINDOW[1]}", report.as_uri())
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    width, height, colours = _png_size_and_colours(shot.read_bytes())
    assert (width, height) == WINDOW
    assert colours > 20  # role colours, text and the memory chart, not a blank page

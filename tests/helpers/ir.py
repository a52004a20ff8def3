"""Program text helpers for tests that pin what a pass wrote: the op lines of a Program's printed form."""
from __future__ import annotations

from fleetc.ir.program import Program

NOTES = "  # "  # every op line ends with its notes (role, module, …); nothing else in the text has them


def op_lines(program: Program, indent: bool = False, attrs: bool = True) -> list[str]:
    """The Program's op lines in printed order (sub-blocks nested), without their notes.

    `indent` keeps the nesting indentation; `attrs=False` also drops the `{…}` attributes after the call.
    """
    lines = [line.split(NOTES)[0] for line in str(program).splitlines() if NOTES in line]
    if not attrs:
        lines = [line.split(") {")[0] + ")" if ") {" in line else line for line in lines]
    return lines if indent else [line.strip() for line in lines]

"""The status of a running experiment: what each cell is doing and the disk it holds, as data, and its display.

`Status` is what the runner knows at one moment (`schedule.Runner.status`); code that needs a cell's state reads
it from there, never from the display. `Display` draws it with rich: a coloured table on a terminal, and on
anything else (a log file, a pipe, a test) the same table as plain text, wide enough that a row never wraps.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from opsd.errors import stdout_dropped
from opsd.paths import size_text

STATES = ("queued", "training", "scoring", "done", "failed")  # a cell's state, in the order counts are shown
_STYLES = {"queued": "dim", "training": "cyan", "scoring": "blue", "done": "green", "failed": "bold red"}
PLAIN_WIDTH = 4096  # columns of the plain table: a cell keeps one line, its log path included


@dataclass(frozen=True)
class CellRow:
    arm: str
    seed: int
    state: str  # one of STATES
    disk_bytes: int  # what the cell holds on disk: its run and its evaluations (`cells.cell_bytes`)
    detail: str  # its progress: the step and seconds per step, the samples scored, or why it failed

    @property
    def cell(self) -> str:
        return f"{self.arm}/{self.seed}"


@dataclass(frozen=True)
class Status:
    time: float  # when it was taken (time.time())
    rows: tuple[CellRow, ...]  # seed by seed, arm by arm
    base_scored: int  # seeds whose base-model evaluation is done
    base_planned: int
    base_running: bool
    eta_s: float | None  # seconds until every job is done, once a cell has finished and jobs remain
    eta_after_first: bool = False  # jobs remain and no cell has finished yet: no estimate until one does

    @property
    def counts(self) -> dict[str, int]:
        """state -> cells in it, for the states some cell is in, in `STATES` order."""
        found = {s: sum(r.state == s for r in self.rows) for s in STATES}
        return {s: n for s, n in found.items() if n}

    @property
    def states(self) -> tuple[tuple[str, int, str], ...]:
        """(arm, seed, state) of every cell: what changes when a cell moves on (not the step it is at)."""
        return tuple((r.arm, r.seed, r.state) for r in self.rows)

    def headline(self) -> str:
        """E.g. `[12:03:04] 4 cells: 1 training, 3 done | base model: 2 of 2 seeds scored | ETA ~12 min`."""
        counts = ", ".join(f"{n} {s}" for s, n in self.counts.items())
        scoring = " (scoring)" if self.base_running else ""
        line = (
            f"[{time.strftime('%H:%M:%S', time.localtime(self.time))}] {len(self.rows)} cells: {counts} | "
            f"base model: {self.base_scored} of {self.base_planned} seeds scored{scoring}"
        )
        if self.eta_s is not None:
            return f"{line} | ETA ~{self.eta_s / 60:.0f} min"
        return f"{line} | ETA: after the first cell" if self.eta_after_first else line


def table(status: Status, *, plain: bool = False) -> Table:
    """The status as a rich Table: one row per cell with its state, the disk it holds and its progress."""
    t = Table(box=box.ASCII2 if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("cell", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("disk", justify="right", no_wrap=True)
    t.add_column("progress", no_wrap=True)
    for r in status.rows:
        style = "" if plain else _STYLES[r.state]
        t.add_row(Text(r.cell), Text(r.state, style=style), Text(size_text(r.disk_bytes)), Text(r.detail))
    return t


class Display:
    """Draws each status it is shown: coloured on a terminal, plain text (no colour, no cursor moves) elsewhere."""

    def __init__(self, file: TextIO | None = None) -> None:
        out = file if file is not None else sys.stdout
        self.plain = not out.isatty()
        self.console = (
            Console(file=out, width=PLAIN_WIDTH, no_color=True, highlight=False, emoji=False, markup=False)
            if self.plain
            else Console(file=out, highlight=False, emoji=False, markup=False)
        )

    def show(self, status: Status) -> None:
        """Draw `status`; once stdout's reader is gone (`| head -1`), nothing more: the jobs run on, the table is
        decoration (`opsd.errors.stdout_dropped`)."""
        try:
            self.console.print(Text(status.headline(), style="" if self.plain else "bold"))
            self.console.print(table(status, plain=self.plain))
            self.console.file.flush()
        except BrokenPipeError:
            if not stdout_dropped():
                raise

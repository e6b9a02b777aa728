"""What the user sees: a live progress view on a terminal, plain log lines anywhere else, and a
summary.

Without a terminal (nohup, Docker without -t, a pipe, a CI log) a live view cannot redraw: it
would show nothing until the end. There, and with --quiet, each iteration (or at most one per
`log.plain_every_s` seconds) gets one whole plain line, never cut or wrapped at 80 columns.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# Width of a console that writes to a file or pipe: wide enough that no line is wrapped or cut.
PLAIN_WIDTH = 10_000


def make_console(stderr: bool = False) -> Console:
    """A console for the CLI: on a terminal, rich as usual; elsewhere lines are never wrapped
    at the 80 columns rich assumes when it cannot ask a terminal."""
    console = Console(stderr=stderr, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=stderr, soft_wrap=True, width=PLAIN_WIDTH)
    return console


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def agent_line(metrics: dict, names: tuple[str, ...]) -> str:
    parts = []
    for name in names:
        role = metrics.get(f"{name}/role", "")
        reward, kl = metrics[f"{name}/task_reward"], metrics[f"{name}/kl"]
        parts.append(f"{name} ({role}) reward {_number(reward)} kl {_number(kl)}")
    return " | ".join(parts)


def _both(values) -> str:
    known = [v for v in values if v is not None]
    return _number(sum(known) / len(known) if known else None)


def _duration(seconds: float) -> str:
    """12s, 3m04s, 2h05m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [m[key] for m in rows if m.get(key) is not None]
    return sum(values) / len(values) if values else None


class Display:
    """Progress for a run: iteration, elapsed/ETA, and each agent's last task reward and KL.

    The live view runs only on a terminal and without `quiet`; otherwise `update` prints plain
    lines, one per iteration or at most one per `plain_every_s` seconds (the last always).
    """

    def __init__(self, console: Console, quiet: bool = False, plain_every_s: float = 0.0):
        self.console, self.quiet, self.plain_every_s = console, quiet, plain_every_s
        self._progress: Progress | None = None
        self._task = None
        self._start = time.monotonic()
        self._last_line: float | None = None
        self._done = 0
        self._warned: set[str] = set()

    @property
    def live(self) -> bool:
        """Whether the live progress view is used (a terminal, not quiet)."""
        return not self.quiet and self.console.is_terminal

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True, markup=False)  # paths, names

    def restore_terminal(self) -> None:
        self.console.show_cursor(True)  # a second Ctrl-C exits from inside the live view

    def warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.message(text)

    def start(self, total: int, done: int = 0) -> None:
        self._start, self._done, self._last_line = time.monotonic(), done, None
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("[bold]iteration"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[agents]}"),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=done, agents="")

    def update(self, metrics: dict, names: tuple[str, ...], total: int) -> None:
        line = agent_line(metrics, names)
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics["iteration"], agents=line)
            return
        now = time.monotonic()
        iteration = metrics["iteration"]
        due = self._last_line is None or now - self._last_line >= self.plain_every_s
        if not (due or iteration >= total):
            return
        self._last_line = now
        elapsed = now - self._start
        eta = ""
        if iteration > self._done:  # this process's own pace (a resumed run started later)
            left = (total - iteration) * elapsed / (iteration - self._done)
            eta = f", eta {_duration(left)}"
        self.console.print(
            f"iteration {iteration}/{total} ({_duration(elapsed)}{eta}) {line}",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, history: list[dict], names: tuple[str, ...], run_dir) -> None:
        """Per agent (and both together): task reward over the first and last iterations (up to
        10 each), KL over the last ones, and the final beta."""
        if not history:
            return
        window = min(10, len(history))
        head, tail = history[:window], history[-window:]
        table = Table(title=f"run summary ({len(history)} iterations)")
        columns = (
            "agent",
            f"task reward, first {window}",
            f"task reward, last {window}",
            f"KL, last {window}",
            "beta",
        )
        for column in columns:
            table.add_column(column, justify="right" if column != "agent" else "left")
        for name in names:
            first, last = _mean(head, f"{name}/task_reward"), _mean(tail, f"{name}/task_reward")
            kl = _mean(tail, f"{name}/kl")
            beta = history[-1][f"{name}/kl_coef"]
            table.add_row(name, _number(first), _number(last), _number(kl), f"{beta:.4f}")
        if len(names) > 1:
            both = [
                (
                    _mean(head, f"{n}/task_reward"),
                    _mean(tail, f"{n}/task_reward"),
                    _mean(tail, f"{n}/kl"),
                )
                for n in names
            ]
            cells = [_both(v) for v in zip(*both, strict=True)]
            table.add_row("both", *cells, "")
        self.console.print(table)
        self.console.print(f"outputs in {run_dir}", highlight=False, markup=False)


class StudyDisplay:
    """Progress of a study: runs done out of all, and the iterations of the run in progress
    (a rich view on a terminal, else one plain line when a run starts and when it ends)."""

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self._progress: Progress | None = None
        self._overall = self._current = None
        self._records: dict = {}

    def start(self, runs, records) -> None:
        self._records = records
        done = sum(r["status"] == "done" for r in records.values())
        self.console.print(
            f"study: {len(runs)} runs, {done} already done", highlight=False, soft_wrap=True
        )
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._progress.start()
        self._overall = self._progress.add_task("[bold]runs", total=len(runs), completed=done)

    def begin(self, run, state: str) -> None:
        verb = {"resume": "resuming", "fresh": "running"}[state]
        if self._progress is None:
            self.console.print(f"{verb} {run.id}", highlight=False, soft_wrap=True, markup=False)
            return
        if self._current is not None:
            self._progress.remove_task(self._current)
        # run ids hold grid values as the user wrote them ([/INST] ...): never markup
        self._current = self._progress.add_task(escape(f"{verb} {run.id}"), total=run.iterations)

    def progress(self, run, iterations_done: int) -> None:
        if self._progress is not None and self._current is not None:
            self._progress.update(self._current, completed=iterations_done)

    def end(self, run, record: dict) -> None:
        text = f"{run.id}: {record['status']}"
        if record["error"]:
            text += f" ({record['error']})"
        if self._progress is None:
            self.console.print(text, highlight=False, soft_wrap=True, markup=False)
            return
        done = sum(r["status"] == "done" for r in self._records.values())
        self._progress.update(self._overall, completed=done)
        if record["status"] != "done":
            self._progress.console.print(text, highlight=False, soft_wrap=True, markup=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

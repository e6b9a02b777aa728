"""What the user sees: a rich progress display (or plain log lines with --quiet) and a summary."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


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


def _mean(rows: list[dict], key: str) -> float | None:
    values = [m[key] for m in rows if m.get(key) is not None]
    return sum(values) / len(values) if values else None


class Display:
    """Progress for a run: iteration, elapsed/ETA, and each agent's last task reward and KL."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console, self.quiet = console, quiet
        self._progress: Progress | None = None
        self._task = None
        self._start = time.monotonic()
        self._warned: set[str] = set()

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True, markup=False)  # paths, names

    def warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.message(text)

    def start(self, total: int, done: int = 0) -> None:
        self._start = time.monotonic()
        if self.quiet:
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
        else:
            elapsed = time.monotonic() - self._start
            self.console.print(
                f"iteration {metrics['iteration']}/{total} ({elapsed:.0f}s) {line}",
                highlight=False,
                soft_wrap=True,
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

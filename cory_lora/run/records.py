"""A run's records: metrics.jsonl (one line per iteration) and samples.jsonl, JSON lines each
appended whole and flushed (`append_jsonl`); metrics read back whole records only
(`read_metrics`, which warns about the lines it leaves out).

Every checkpoint carries a copy of the logs up to it (`snapshot_logs`), so a resume restores
them whole (`restore_logs`) even when a line of the live log was damaged since; `log_damage`
says what is wrong with the live logs before a checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cory_lora.errors import UserError, os_error_message
from cory_lora.run.atomic import atomic_write_text

LOGS = ("metrics.jsonl", "samples.jsonl")
LOG_SNAPSHOT = "logs"  # inside each checkpoint: the logs up to it


_WARNED: set[Path] = set()  # metrics files already warned about in this process


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records, one per iteration. A line that is not a whole record (bytes
    that are not UTF-8, not a JSON object, no iteration number, a metric that is neither a
    number nor null) is left out, with one warning per file naming the lines; a last line
    without its newline is what a run being written (or killed) leaves, and is left out
    silently."""
    records, damaged = [], []
    try:
        raw_lines = Path(path).read_bytes().split(b"\n")
    except IsADirectoryError:
        raise UserError(f"{path} is a directory where a file should be") from None
    except OSError as e:
        raise UserError(os_error_message(e, f"cannot read {path}")) from None
    last = len(raw_lines) - 1  # the text after the final newline: empty, or a line cut short
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        record = _metrics_record(raw)
        if record is not None:
            records.append(record)
        elif number <= last:
            damaged.append(number)
    if damaged and Path(path) not in _WARNED:
        _WARNED.add(Path(path))
        print(
            f"warning: {path}: {len(damaged)} damaged line(s) left out (line(s) "
            f"{_ranges(damaged)}: not a whole metrics record)",
            file=sys.stderr,
        )
    return records


def _metrics_record(raw: bytes) -> dict | None:
    """One metrics line as a record, or None when it is damaged."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(record, dict):
        return None
    iteration = record.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 1:
        return None
    for key, value in record.items():
        text = key.endswith("/role") and isinstance(value, str)
        if not (text or value is None or isinstance(value, (int, float))):
            return None
    return record


def read_json(path: Path) -> dict:
    """A JSON object file (study.json, eval.json, state.json); any damage is one UserError naming
    the file."""
    text = _text(path)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{path} is damaged (not valid JSON: {e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is damaged (expected a JSON object)")
    return data


def _text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise UserError(f"{path} is a directory where a file should be") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is damaged (not UTF-8 text)") from None
    except OSError as e:
        raise UserError(os_error_message(e, f"cannot read {path}")) from None


def append_jsonl(path: Path, records: list[dict]) -> None:
    """Append JSON lines; each line is written whole and flushed to disk."""
    if not records:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def snapshot_logs(run_dir: Path, iteration: int, target: Path, previous: Path | None) -> None:
    """Write into `target` the log records of iterations 1..`iteration`, for a checkpoint:
    those up to the `previous` checkpoint from its own copy (so damage to old lines of the live
    log is not carried forward), the newer ones from the live logs."""
    target.mkdir()
    earlier = previous / LOG_SNAPSHOT if previous is not None else None
    if earlier is not None and not earlier.is_dir():
        earlier = None  # written by an older version: take everything from the live logs
    since = int(previous.name.split("-")[-1]) if earlier is not None else 0
    for name in LOGS:
        live = Path(run_dir) / name
        old = (
            _log_lines(earlier / name) if earlier is not None and (earlier / name).is_file() else []
        )
        new = []
        if live.exists():
            new = [
                (it, line)
                for it, line in _log_lines(live)
                if it is not None and since < it <= iteration
            ]
        if old or new or live.exists():
            (target / name).write_text("".join(line for _, line in old + new), encoding="utf-8")


def restore_logs(run_dir: Path, snapshot: Path, iterations: int) -> None:
    """Make the live logs of `run_dir` hold exactly the records of iterations 1..`iterations`:
    the copy in `snapshot` (that checkpoint's LOG_SNAPSHOT directory) where it has one, else the
    live log's own lines up to it."""
    for name in LOGS:
        path, copy = run_dir / name, snapshot / name
        if copy.is_file():
            atomic_write_text(path, copy.read_text(encoding="utf-8"))
        elif path.exists():
            kept = [line for it, line in _log_lines(path) if it is not None and it <= iterations]
            atomic_write_text(path, "".join(kept))


def log_damage(run_dir: Path, snapshot: Path, iterations: int) -> str | None:
    """What is wrong with the live logs of `run_dir` up to iteration `iterations`, or None:
    lines cut short or unreadable, iterations missing or repeated (compared with the copy in
    `snapshot`, that checkpoint's LOG_SNAPSHOT directory, when it has one, else with
    1..iterations)."""
    problems = []
    for name in LOGS:
        problem = _damage(name, run_dir / name, snapshot / name, iterations)
        if problem is not None:
            problems.append(problem)
    if not problems:
        return None
    return (
        f"the log of {run_dir} is damaged before its checkpoint at iteration {iterations}: "
        + "; ".join(problems)
    )


def _damage(name: str, path: Path, copy: Path, iterations: int) -> str | None:
    """What is wrong with the live log `path` (LOGS' `name`) up to `iterations`, compared with
    the checkpoint's `copy` of it, or None."""
    if not path.exists():
        return f"{name}: missing" if copy.is_file() and copy.stat().st_size else None
    lines = _log_lines(path)
    cut = [n for n, (it, _) in enumerate(lines, 1) if it is None]
    ours = [(it, line) for it, line in lines if it is not None and it <= iterations]
    if copy.is_file():
        expected = _log_lines(copy)
        if ours == expected:
            return None
        missing = sorted({it for it, _ in expected} - {it for it, _ in ours})
    else:
        if name != "metrics.jsonl":
            return None  # one line per iteration only in metrics.jsonl
        wanted = list(range(1, iterations + 1))
        if [it for it, _ in ours] == wanted:
            return None
        missing = sorted(set(wanted) - {it for it, _ in ours})
    detail = []
    if missing:
        detail.append(f"iteration(s) {_ranges(missing)} missing")
    if cut:
        detail.append(f"line(s) {_ranges(cut)} cut short or unreadable")
    if not detail:
        detail.append("lines changed, repeated or out of order")
    return f"{name}: {', '.join(detail)}"


def _log_lines(path: Path) -> list[tuple[int | None, str]]:
    """(iteration, line with its newline) per line; iteration None for a line that is not a
    whole JSON record with an integer iteration (cut short by a crash, or damaged)."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                record = None
            iteration = record.get("iteration") if isinstance(record, dict) else None
            ok = isinstance(iteration, int) and not isinstance(iteration, bool)
            out.append((iteration if ok else None, line if line.endswith("\n") else line + "\n"))
    return out


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)

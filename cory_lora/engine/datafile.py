"""A local data file checked before `datasets` reads it, so that damage gets one message naming
the file and the line (datasets' own errors name neither, count rows from 0, or speak of
"instructions"): bytes that are not UTF-8, a JSON line cut short, a line that is not an object,
a file with no rows."""

from __future__ import annotations

import json
from pathlib import Path

from cory_lora.config import DATA_FILE_SUFFIXES
from cory_lora.errors import UserError, os_error_message

TEXT_SUFFIXES = (".jsonl", ".json", ".csv")  # parquet is binary: datasets' own check names it


def check_data_file(path: Path, key: str) -> None:
    """Raise one UserError (prefixed `key`, e.g. "data.dataset = '…'") for a local data file
    that `datasets` would fail on or read as nothing."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{key}: {path} is a directory where a data file should be")
    if path.suffix not in TEXT_SUFFIXES:
        return
    text = _utf8(path, key)
    if path.suffix == ".jsonl":
        _check_json_lines(text, path, key)
    elif path.suffix == ".json":
        _check_json(text, path, key)
    elif len([line for line in text.splitlines() if line.strip()]) < 2:
        raise UserError(f"{key}: {path} has no rows (a CSV file needs a header line and rows)")


def split_files(directory: Path, split: str) -> list[Path]:
    """The data files of a directory that `datasets` reads as `split` (train.jsonl,
    train-00000.csv, data/train.json, …)."""
    found = []
    for folder in (directory, directory / "data"):
        if folder.is_dir():
            found += [
                p
                for p in sorted(folder.iterdir())
                if p.suffix in DATA_FILE_SUFFIXES
                and (p.stem == split or p.stem.startswith(f"{split}-"))
            ]
    return found


def _utf8(path: Path, key: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(os_error_message(e, f"{key}: cannot read {path}")) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{key}: {path} line {line} is not UTF-8 text (byte {data[e.start]:#04x}); "
            "save the file as UTF-8"
        ) from None


def _check_json_lines(text: str, path: Path, key: str) -> None:
    rows = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(
                f"{key}: {path} line {number} is not valid JSON ({e.msg}, column {e.colno}); "
                "a JSON-lines file holds one whole object per line"
            ) from None
        if not isinstance(record, dict):
            raise UserError(
                f"{key}: {path} line {number} holds a JSON {type(record).__name__}, not an "
                'object; each line must be one row, such as {"question": "…", "answer": "…"}'
            )
        rows += 1
    if not rows:
        why = "only blank lines" if text else "the file is empty"
        raise UserError(f"{key}: {path} has no rows ({why})")


def _check_json(text: str, path: Path, key: str) -> None:
    try:
        data = json.loads(text)
    except ValueError as e:
        if e.msg == "Extra data" and _first_line_is_an_object(text):
            return _check_json_lines(text, path, key)  # JSON lines in a .json file: datasets' way
        raise UserError(
            f"{key}: {path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno})"
        ) from None
    if isinstance(data, list) and not all(isinstance(row, dict) for row in data):
        raise UserError(
            f"{key}: {path} holds a JSON list of something other than objects; it must be a "
            'list of rows such as {"question": "…", "answer": "…"}'
        )
    if data == [] or data == {}:
        raise UserError(f"{key}: {path} has no rows")


def _first_line_is_an_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text.lstrip().splitlines()[0]), dict)
    except (ValueError, IndexError):
        return False

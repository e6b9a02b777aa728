"""The shapes of the files a report reads back: a study's study.json and a run's eval.json.

Both are written by cory-lora, but they sit on disks, in repositories and in archives, where
they get cut short, edited or mixed up. Each is checked whole before any number of it is used,
so that damage is one message naming the file and the key, never an internal error halfway
through a report.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cory_lora.config.problems import first_record_problem
from cory_lora.errors import UserError
from cory_lora.run.records import read_json

Number = float | None  # a figure that may be absent (accuracy when the reward is not 0/1)


class _Record(BaseModel):
    # strict: no "0.5" for 0.5; extra keys allowed, so an older or newer file still reads
    model_config = ConfigDict(strict=True, extra="allow")


class StudyRun(_Record):
    id: str
    arm: str
    grid: dict[str, object]
    seed: int
    dir: str
    status: Literal["pending", "done", "failed", "interrupted"]
    error: str | None = None

    @field_validator("dir")
    @classmethod
    def _inside_the_study(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or not value:
            raise ValueError("must be a path inside the study directory")
        return value


class StudyRecord(_Record):
    """study.json: the study's settings and every run's status."""

    window: int = Field(ge=1)
    etas: list[float]
    runs: list[StudyRun]
    study: str = ""


class EvalRow(_Record):
    name: str
    task_reward: Number
    kl: Number
    combined_reward: Number
    accuracy: Number = None
    pass_at: dict[str, float] = {}


class EvalRecord(_Record):
    """eval.json: one row per agent alone, pair and base."""

    rows: list[EvalRow]
    k: list[int] = []


def read_record(path: Path, schema: type[_Record]) -> dict:
    """The JSON object file at `path`, checked against `schema` (one UserError naming the file
    and the first wrong key); returned as the plain dict it holds."""
    data = read_json(path)
    try:
        schema.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{path} is damaged ({first_record_problem(e)})") from None
    return data

"""pydantic's validation errors in the words of a TOML file: the (dotted) key, the value as the
user wrote it, and what it must be. Used for recipe sections and study files alike."""

from __future__ import annotations

import json
import typing
from difflib import get_close_matches
from typing import Annotated

from pydantic import BaseModel, ValidationError

from cory_lora.errors import Problem

BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}
TYPE_WORDS = {
    "bool_type": "expected true or false",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "finite_number": "must be a finite number",
    "list_type": "expected a list",
    "dict_type": "expected a table",
    "model_type": "expected a table",
    "too_short": "must not be empty",
    "string_too_short": "must not be empty",
}


def show(value) -> str:
    """A value as the user wrote it in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, dict)):
        return json.dumps(value)
    return str(value)


def field_doc(model: type[BaseModel], key: str) -> str:
    """A field's description (its attribute docstring) on one line."""
    return " ".join((model.model_fields[key].description or "").split())


def first_record_problem(error: ValidationError) -> str:
    """A machine-written record's (JSON file's) first problem as `dotted.key: what is wrong`:
    records are not typed by users, so one problem, by key, is enough to name the damage."""
    e = error.errors()[0]
    where = ".".join(str(part) for part in e["loc"]) or "the file"
    return f"{where}: {'missing' if e['type'] == 'missing' else e['msg']}"


def schema_problems(
    error: ValidationError, cls: type[BaseModel], table: dict, prefix: str = ""
) -> list[Problem]:
    """One Problem per error of `cls.model_validate(table)`; keys are `prefix` + the field name."""
    out = []
    for e in error.errors():
        key = str(e["loc"][0])
        dotted = prefix + key
        if e["type"] == "extra_forbidden":
            fields = list(cls.model_fields)
            close = [k for k in fields if k.startswith(key[:3])] or get_close_matches(key, fields)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            out.append(Problem((dotted,), f"{dotted}: unknown key{hint}"))
            continue
        if e["type"] == "missing":
            doc = field_doc(cls, key)
            out.append(
                Problem((dotted,), f"{dotted}: required ({doc})" if doc else f"{dotted}: required")
            )
            continue
        text = expected(cls.model_fields[key].annotation, e)
        out.append(Problem((dotted,), f"{dotted} = {show(table.get(key))}: {text}"))
    return out


def expected(annotation, error: dict) -> str:
    """What the value must be, from one pydantic error on a field of type `annotation`."""
    kind, in_item = error["type"], len(error["loc"]) > 1
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind in BOUNDS:
        name, word = BOUNDS[kind]
        bound = error["ctx"][name]
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"{'every item ' if in_item else ''}must be {word} {bound}"
    if kind == "literal_error":
        return f"must be one of {', '.join(map(str, typing.get_args(annotation)))}"
    origin = typing.get_origin(annotation)
    if (origin is dict and kind not in TYPE_WORDS) or (origin is dict and in_item):
        return 'expected a table of strings, e.g. { old = "new" }'
    if origin in (tuple, list) and (in_item or kind in ("tuple_type", "list_type")):
        item = typing.get_args(annotation)[0]
        item = typing.get_args(item)[0] if typing.get_args(item) else item
        words = {str: "strings", int: "integers", float: "numbers"}
        return f"expected a list of {words.get(item, 'values')}"
    return TYPE_WORDS.get(kind, error["msg"])


def _plain(annotation):
    """int for Annotated[int, Strict(), ...]; the type itself otherwise."""
    return (
        typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
    )

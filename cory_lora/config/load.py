"""Reading a recipe: TOML, `--set` overrides, the schema, then the checks between keys.

Loading never stops at the first problem: unknown sections and keys (by dotted path), wrong
types, out-of-range values and inconsistent pairs are all collected, each as a
`Problem(keys, text)`, and raised as one `ConfigError`. pydantic reports every bad field of a
section at once; the section is then built again without them (their defaults stand in), so the
checks between keys still run, leaving out any that involve a key already reported.

`--set section.key=value` overrides are parsed as TOML values (so `--set train.iterations=5` is an
int); for string fields a bare word is taken as the string itself (`--set model.name_or_path=gpt2`).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Literal

import tomli_w
from pydantic import ValidationError

from cory_lora.config.checks import cross_checks
from cory_lora.config.problems import schema_problems, show
from cory_lora.config.sections import (
    DATA_FILE_SUFFIXES,
    PER_AGENT,
    SECTIONS,
    AgentOverride,
    Recipe,
    Section,
    to_dict,
)
from cory_lora.errors import ConfigError, Problem


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raise one ConfigError listing every problem."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(
            [Problem((), f"recipe {str(path)!r} is a directory; name a recipe .toml file")]
        )
    if not path.is_file():
        raise ConfigError([Problem((), f"recipe {str(path)!r}: no such file")])
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the TOML
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError([Problem((), f"recipe {str(path)!r} is not valid TOML: {e}")]) from None
    except OSError as e:
        raise ConfigError(
            [Problem((), f"recipe {str(path)!r} cannot be read: {e.strerror}")]
        ) from None
    recipe = recipe_from_dict(raw, overrides)
    if problems := paths_run_from_elsewhere(recipe, path):
        raise ConfigError(problems)
    return recipe


def paths_run_from_elsewhere(recipe: Recipe, recipe_path: Path) -> list[Problem]:
    """A relative model or data path is read from the current directory. One that is not there
    but is found beside the recipe or a few folders above it (a project root, a run directory's
    project) means the command was started elsewhere: say so now, rather than after a minute of
    asking the hub for a model named like the path."""
    problems = []
    for key, value in (
        ("model.name_or_path", recipe.model.name_or_path),
        ("data.dataset", recipe.data.dataset),
    ):
        local = "/" in value or Path(value).suffix in DATA_FILE_SUFFIXES
        if not local or Path(value).is_absolute() or value.startswith("~") or Path(value).exists():
            continue  # a bare word is a hub id as often as a folder
        here = Path(recipe_path).resolve().parent
        for folder in (here, *list(here.parents)[:3]):
            if (folder / value).exists():
                problems.append(
                    Problem(
                        (key,),
                        f"{key} = {value!r} is not in the current directory ({Path.cwd()}), "
                        f"but {folder / value} exists: relative paths in a recipe are read "
                        f"from where the command runs. Run it from {folder}, or write the "
                        "full path",
                    )
                )
                break
    return problems


def recipe_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Recipe:
    problems: list[Problem] = []
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        _apply_override(raw, text, problems)
    agent_tables = raw.pop("agents", [])
    for name, value in raw.items():
        if name not in SECTIONS:
            known = ", ".join(SECTIONS)
            problems.append(Problem((name,), f"{name}: unknown section (known: {known})"))
        elif not isinstance(value, dict):
            text = f"{name}: expected a [{name}] table, got {show(value)}"
            problems.append(Problem((name,), text))
    sections = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        sections[name] = build_section(
            name, cls, table if isinstance(table, dict) else {}, problems
        )
    per_agent = _agent_overrides(agent_tables, problems)
    recipe = expand_home(Recipe(**sections, agent_overrides=per_agent))
    # A problem between keys that involves a key already reported would talk about a default
    # the user did not write: left out.
    reported = {key for p in problems for key in p.keys}
    problems.extend(c for c in cross_checks(recipe) if not reported.intersection(c.keys))
    if problems:
        raise ConfigError(problems)
    return recipe


# Keys that name a local path when they start with `~`: expanded once, here, so every check and
# every reader sees the same path (a hub id never starts with `~`).
PATH_KEYS = (
    ("model", "name_or_path"),
    ("data", "dataset"),
    ("train", "output_dir"),
    ("reward", "model"),
)


def expand_home(recipe: Recipe) -> Recipe:
    """The recipe with `~` and `~user` expanded in its path keys (as a shell would have)."""
    for section, key in PATH_KEYS:
        table = getattr(recipe, section)
        value = getattr(table, key)
        if isinstance(value, str) and value.startswith("~"):
            expanded = os.path.expanduser(value)
            if expanded != value:
                table = table.model_copy(update={key: expanded})
                recipe = recipe.model_copy(update={section: table})
    return recipe


def build_section(name: str, cls: type[Section], table: dict, problems: list[Problem]) -> Section:
    """The section from its table; each bad key becomes a problem and keeps its default."""
    try:
        return cls.model_validate(table)
    except ValidationError as e:
        problems.extend(schema_problems(e, cls, table, prefix=f"{name}."))
        bad = {str(error["loc"][0]) for error in e.errors()}
        return cls.model_validate({k: v for k, v in table.items() if k not in bad})


def _agent_overrides(tables, problems: list[Problem]) -> tuple[AgentOverride, ...]:
    """The [[agents]] tables, validated like the sections they override; problems name the
    agent and the key."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        problems.append(Problem(("agents",), "agents: expected [[agents]] tables"))
        return ()
    out, seen = [], set()
    for i, table in enumerate(tables, start=1):
        table = dict(table)
        name = table.pop("name", None)
        where = f"[[agents]] #{i}" if not isinstance(name, str) else f"[[agents]] {name}"
        if not isinstance(name, str) or not re.fullmatch(r"llm[1-9]\d*", name):
            problems.append(Problem(("agents",), f'{where}: needs name = "llmK" (the agent)'))
            continue
        if name in seen:
            problems.append(Problem(("agents",), f"{where}: a second table for the same agent"))
            continue
        seen.add(name)
        keys = _agent_keys(where, table, problems)
        out.append(AgentOverride(name=name, lora=keys.get("lora", {}), ppo=keys.get("ppo", {})))
    return tuple(out)


def _agent_keys(where: str, table: dict, problems: list[Problem]) -> dict[str, dict]:
    """{section: {key: validated value}} of one [[agents]] table."""
    keys = {}
    known = ", ".join(f"{s}.{k}" for s, ks in PER_AGENT.items() for k in ks)
    for section, value in table.items():
        allowed = PER_AGENT.get(section)
        if allowed is None or not isinstance(value, dict):
            text = f"{where}: {section}: not settable per agent ({known})"
            problems.append(Problem(("agents",), text))
            continue
        for key in [k for k in value if k not in allowed]:
            per_agent = ", ".join(f"{section}.{k}" for k in allowed)
            text = f"{where}: {section}.{key} is shared by every agent (per agent: {per_agent})"
            problems.append(Problem(("agents",), text))
        wanted = {k: v for k, v in value.items() if k in allowed}
        found: list[Problem] = []
        built = build_section(section, SECTIONS[section], wanted, found)
        problems.extend(Problem(("agents",), f"{where}: {p.text}") for p in found)
        keys[section] = {k: getattr(built, k) for k in wanted}
    return keys


BARE_WORD = re.compile(r"[^\"'\[\]{}=\s][^\"'\[\]{}=]*")  # gpt2, openai/gsm8k, a b, 2024-01


def _apply_override(raw: dict, text: str, problems: list[Problem]) -> None:
    dotted, sep, value_text = text.partition("=")
    parts = dotted.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        problems.append(Problem((), f"--set {text!r}: expected section.key=value"))
        return
    section, key = parts
    value = _override_value(SECTIONS.get(section), key, value_text.strip())
    if value is None:
        problems.append(
            Problem((f"{section}.{key}",), f"--set {text!r}: not a TOML value or a bare word")
        )
        return
    table = raw.setdefault(section, {})
    if isinstance(table, dict):
        table[key] = value
    else:
        problems.append(
            Problem((section,), f"--set {text!r}: {section} is not a table in the recipe")
        )


def _override_value(cls: type[Section] | None, key: str, text: str):
    """The value of `--set section.key=TEXT`: a TOML value, or for a string key a bare word taken
    as it is; None when it is neither (e.g. `"a" "b"`)."""
    field = cls.model_fields.get(key) if cls is not None else None
    annotation = field.annotation if field is not None else None
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()
    wants_str = annotation is str or (choices and all(isinstance(c, str) for c in choices))
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text if BARE_WORD.fullmatch(text) else None
    if wants_str and not isinstance(value, (str, list, dict)):
        # e.g. --set data.split=2024 means the string "2024"; a list or table stays one, and
        # is refused as in a recipe file ("expected a string")
        return text
    return value


def recipe_toml(recipe: Recipe) -> str:
    """The resolved recipe as TOML that `load_recipe` reads back to an equal Recipe."""
    tables = to_dict(recipe)
    agents = tables.pop("agents", [])
    # [[agents]] first, as an array of tables, then the sections (tomli_w writes scalars first).
    head = tomli_w.dumps({"agents": agents}) + "\n" if agents else ""
    return head + tomli_w.dumps(tables)


def toml_value(value) -> str:
    """One value as inline TOML, on one line (study run names, the keys table)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")

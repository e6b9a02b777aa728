"""Checks between keys that no single field's type or range can make: one function per concern,
each returning its problems. `cross_checks` runs them all on a built recipe (load.py leaves a
key with a bad value at its default first, so these run even then)."""

from __future__ import annotations

import re
import string

from cory_lora.config.problems import field_doc, show
from cory_lora.config.sections import REQUIRED, SECTIONS, Recipe
from cory_lora.errors import Problem
from cory_lora.services.fetch import is_fetched_name, unknown_name_problem

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
OBSERVER_PLACEHOLDERS = {"query", "pioneer", "answers"}


def cross_checks(r: Recipe) -> list[Problem]:
    return [
        *required(r),
        *agent_tables(r),
        *ppo_batches(r),
        *ppo_advantages(r),
        *generation(r),
        *data(r),
        *templates(r),
        *log(r),
        *reward(r),
        *model(r),
    ]


def problem(keys: str, text: str) -> Problem:
    """A problem about the space-separated dotted `keys`."""
    return Problem(tuple(keys.split()), text)


def required(r: Recipe) -> list[Problem]:
    out = []
    for dotted in REQUIRED:
        section, key = dotted.split(".")
        if not getattr(getattr(r, section), key):
            doc = field_doc(SECTIONS[section], key)
            out.append(problem(dotted, f"{dotted}: required ({doc})"))
    return out


def agent_tables(r: Recipe) -> list[Problem]:
    out = []
    for override in r.agent_overrides:
        if override.name not in r.agent_names:
            trained = ", ".join(r.agent_names)
            text = f"the recipe trains {trained} (cory.agents, train.algorithm)"
            out.append(problem("agents", f"[[agents]] {override.name}: {text}"))
        elif not r.lora_of(override.name).target_modules:
            text = "lora.target_modules: name a module"
            out.append(problem("agents", f"[[agents]] {override.name}: {text}"))
    if not r.lora.target_modules:
        out.append(
            problem("lora.target_modules", "lora.target_modules: must name at least one module")
        )
    return out


def ppo_batches(r: Recipe) -> list[Problem]:
    out, p, g = [], r.ppo, r.generation
    episodes = p.batch_size * g.samples_per_query
    if episodes % p.minibatch_size:
        per_query = f" x generation.samples_per_query = {g.samples_per_query}"
        out.append(
            problem(
                "ppo.minibatch_size ppo.batch_size",
                f"ppo.minibatch_size = {p.minibatch_size} must divide ppo.batch_size = "
                f"{p.batch_size}"
                + (per_query + f" = {episodes} episodes" if g.samples_per_query > 1 else ""),
            )
        )
    if p.minibatch_size % p.micro_batch_size:
        out.append(
            problem(
                "ppo.micro_batch_size ppo.minibatch_size",
                f"ppo.micro_batch_size = {p.micro_batch_size} must divide "
                f"ppo.minibatch_size = {p.minibatch_size}",
            )
        )
    return out


def ppo_advantages(r: Recipe) -> list[Problem]:
    out, p, g = [], r.ppo, r.generation
    if p.advantage != "gae" and g.samples_per_query < 2:
        out.append(
            problem(
                "ppo.advantage generation.samples_per_query",
                f"ppo.advantage = {p.advantage!r} compares answers to the same query: it needs "
                f"generation.samples_per_query >= 2 (it is {g.samples_per_query})",
            )
        )
    if p.kl_in == "loss" and p.advantage == "gae":
        out.append(
            problem(
                "ppo.kl_in ppo.advantage",
                "ppo.kl_in = 'loss' is for the critic-free advantages (ppo.advantage = 'rloo' or "
                "'grpo'); GAE takes the KL in its per-token rewards",
            )
        )
    if p.score_norm and not p.score_scaling:
        out.append(
            problem(
                "ppo.score_norm ppo.score_scaling",
                "ppo.score_norm = true needs ppo.score_scaling = true",
            )
        )
    return out


def generation(r: Recipe) -> list[Problem]:
    out, g = [], r.generation
    if 0 < g.temperature < 1e-4:
        out.append(
            problem(
                "generation.temperature",
                f"generation.temperature = {g.temperature!r}: too small to sample with (logits "
                "divided by it overflow); use 0 for greedy decoding",
            )
        )
    if g.min_new_tokens > g.max_new_tokens:
        out.append(
            problem(
                "generation.min_new_tokens generation.max_new_tokens",
                f"generation.min_new_tokens = {g.min_new_tokens} exceeds "
                f"generation.max_new_tokens = {g.max_new_tokens}",
            )
        )
    lo_bound, hi_bound = max(1, g.min_new_tokens), g.max_new_tokens + 1
    span = g.length_range
    if span and not (len(span) == 2 and lo_bound <= span[0] < span[1] <= hi_bound):
        out.append(
            problem(
                "generation.length_range generation.max_new_tokens generation.min_new_tokens",
                f"generation.length_range = {list(span)}: need [lo, hi] with "
                f"max(1, generation.min_new_tokens) <= lo < hi <= generation.max_new_tokens + 1 "
                f"= {hi_bound} (hi is exclusive)",
            )
        )
    if any(not s for s in g.stop):
        out.append(problem("generation.stop", "generation.stop: stop strings must not be empty"))
    return out


def data(r: Recipe) -> list[Problem]:
    out, d = [], r.data
    lo, hi = d.query_min_tokens, d.query_max_tokens
    if (lo or hi) and not 0 < lo < hi:
        out.append(
            problem(
                "data.query_min_tokens data.query_max_tokens",
                f"data.query_min_tokens = {lo} and data.query_max_tokens = {hi}: need "
                "0 < min < max (max is exclusive)",
            )
        )
    if d.eval_split and d.eval_holdout:
        out.append(
            problem(
                "data.eval_split data.eval_holdout",
                "data.eval_split and data.eval_holdout: set one, not both",
            )
        )
    if d.eval_split and d.eval_split == d.split:
        out.append(
            problem(
                "data.eval_split data.split",
                f"data.eval_split = {show(d.eval_split)} is the training split (data.split): "
                "held-out prompts must be other prompts",
            )
        )
    return out


def templates(r: Recipe) -> list[Problem]:
    out = []
    for key, template, allowed in (
        ("data.prompt_template", r.data.prompt_template, None),
        ("cory.observer_template", r.cory.observer_template, OBSERVER_PLACEHOLDERS),
    ):
        text = template_problem(template, allowed, needs_answers=r.train.algorithm == "cory")
        if text:
            keys = f"{key} train.algorithm" if "must contain" in text else key
            out.append(problem(keys, f"{key}{text}"))
    return out


def template_problem(template: str, allowed: set | None, needs_answers: bool) -> str | None:
    """What is wrong with a prompt template (the text follows its key), or None."""
    names = template_fields(template)
    if names is None:
        return f" = {show(template)}: malformed {{}} placeholders"
    if any(not n.isidentifier() for n in names):
        return f" = {show(template)}: placeholders must be plain names"
    if format_problem := _format_problem(template):
        return f" = {show(template)}: {format_problem}"
    if allowed is None:
        return None
    if not names <= allowed:
        unknown = ", ".join(sorted(names - allowed))
        return f": unknown placeholder(s) {unknown} (known: query, pioneer, answers)"
    if needs_answers and not names & {"pioneer", "answers"}:
        return " must contain {pioneer} or {answers}: the observer reads the answers before its own"
    return None


def template_fields(template: str) -> set[str] | None:
    """Names used by a str.format template, or None when the template is malformed."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError:
        return None


def _format_problem(template: str) -> str | None:
    """Conversions and format specs a str.format template would fail on. Specs are checked
    against text for {query}, {pioneer} and {answers}; other columns may be numbers (checked on
    the data)."""
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            return f"{{{name}!{conversion}}}: unknown conversion (!r, !s and !a exist)"
        if "{" in spec:
            return f"{{{name}:{spec}}}: placeholders inside a format spec are not supported"
        if name in OBSERVER_PLACEHOLDERS:
            try:
                format("", spec)
            except ValueError as e:
                return f"{{{name}:{spec}}}: not a format for text ({e})"
    return None


def log(r: Recipe) -> list[Problem]:
    unknown = [t for t in r.log.report_to if t not in TRACKERS]
    if not unknown:
        return []
    text = f"unknown tracker(s) {', '.join(unknown)} (known: {', '.join(TRACKERS)})"
    return [problem("log.report_to", f"log.report_to: {text}")]


def reward(r: Recipe) -> list[Problem]:
    out, w = [], r.reward
    if w.function == "http_reward" and not w.url:
        out.append(problem("reward.url", 'reward.url: required by reward.function = "http_reward"'))
    if w.url and not w.url.startswith(("http://", "https://")):
        text = f"reward.url = {show(w.url)}: expected an http:// or https:// URL"
        out.append(problem("reward.url", text))
    module, colon, function = w.function.partition(":")
    names_ok = all(part.isidentifier() for part in module.split(".")) and function.isidentifier()
    if colon and not names_ok:
        out.append(
            problem(
                "reward.function",
                f"reward.function = {show(w.function)}: expected module:function, "
                "e.g. my_rewards:score",
            )
        )
    return out


def model(r: Recipe) -> list[Problem]:
    out, m = [], r.model
    if is_fetched_name(m.name_or_path) and (unknown := unknown_name_problem(m.name_or_path)):
        out.append(problem("model.name_or_path", f"model.name_or_path = {unknown}"))
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", m.device):
        text = f"model.device = {show(m.device)}: expected auto, cpu, cuda or cuda:N"
        out.append(problem("model.device", text))
    return out

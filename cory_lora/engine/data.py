"""Prompts: loading a dataset (hub id or local files), formatting and tokenising prompts, and a
seeded, resumable order over them."""

from __future__ import annotations

import numbers
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cory_lora.config import DATA_FILE_BUILDERS, DataConfig, template_fields
from cory_lora.engine.datafile import check_data_file, split_files
from cory_lora.errors import UserError


@dataclass(frozen=True)
class PromptSet:
    """Queries and every dataset column (the reward receives the columns as keyword lists)."""

    queries: list[str]
    columns: dict[str, list]

    def __len__(self) -> int:
        return len(self.queries)

    def take(self, indices: list[int]) -> PromptSet:
        return PromptSet(
            [self.queries[i] for i in indices],
            {name: [values[i] for i in indices] for name, values in self.columns.items()},
        )

    def rows(self) -> list[dict]:
        return [{k: v[i] for k, v in self.columns.items()} for i in range(len(self))]


def load_prompts(
    cfg: DataConfig, tokenizer=None, seed: int = 0, split: str | None = None
) -> PromptSet:
    """The training prompts (default data.split, minus any eval_holdout rows), or `split`.

    Columns named by the recipe are checked; IMDB-style queries (min_query_chars, query token
    prefixes) are built here, once, with `seed`.
    """
    split = split or cfg.split
    prompts = _prepare(cfg, _load_split(cfg, split), split, tokenizer, seed)
    if cfg.eval_holdout and split == cfg.split:
        held_out = set(_holdout(len(prompts), cfg.eval_holdout, seed))
        prompts = prompts.take([i for i in range(len(prompts)) if i not in held_out])
        if len(prompts) == 0:
            raise UserError(f"data.eval_holdout = {cfg.eval_holdout} leaves no training prompts")
    return prompts


HOLDOUT = "holdout"  # the name `cory-lora eval` gives the data.eval_holdout rows


def eval_split(cfg: DataConfig, split: str | None = None) -> tuple[str, bool]:
    """(name, held out?) of the prompts `cory-lora eval` scores: `split`, else data.eval_split,
    else the data.eval_holdout rows ("holdout"), else the dataset's `test` split.

    Held out means held out: a single data file holds only the training prompts, so asking it
    for another split, or for held-out prompts without data.eval_holdout, is refused. The
    training split itself is scored only when asked for by name (and labelled as such)."""
    if split is None and cfg.eval_split:
        split = cfg.eval_split
    if split is None and cfg.eval_holdout:
        return HOLDOUT, True
    if split == HOLDOUT and cfg.eval_holdout:
        return HOLDOUT, True
    if split == cfg.split:
        return split, False
    path = Path(cfg.dataset)
    if path.is_file():
        beside = sorted(p.name for p in path.parent.glob(f"{split or 'test'}.*") if p != path)
        hint = (
            f" ({beside[0]} is beside it: data.dataset = {str(path.parent)!r} reads each file "
            "as the split of its name)"
            if beside
            else ""
        )
        if split is None:
            raise UserError(
                f"this run has no held-out prompts: data.dataset = {cfg.dataset!r} is one file, "
                "its rows are the training prompts, and neither data.eval_split nor "
                f"data.eval_holdout is set{hint}. Evaluate a run whose recipe sets "
                "data.eval_holdout = N (rows kept out of training), or pass --split "
                f"{cfg.split} to score the training prompts knowingly"
            )
        raise UserError(
            f"--split {split!r}: data.dataset = {cfg.dataset!r} is one file, which holds only "
            f"the training split {cfg.split!r}"
            + (
                f" (and the {cfg.eval_holdout} held-out rows: --split {HOLDOUT})"
                if cfg.eval_holdout
                else ""
            )
            + hint
        )
    return split or "test", True


def load_eval_prompts(cfg: DataConfig, tokenizer=None, seed: int = 0, split: str | None = None):
    """The prompts `eval_split(cfg, split)` names (the eval_holdout rows are the same seeded
    choice that load_prompts keeps out of training)."""
    name, _ = eval_split(cfg, split)
    if name == HOLDOUT and cfg.eval_holdout:
        prompts = _prepare(cfg, _load_split(cfg, cfg.split), cfg.split, tokenizer, seed)
        return prompts.take(_holdout(len(prompts), cfg.eval_holdout, seed))
    return _prepare(cfg, _load_split(cfg, name), name, tokenizer, seed)


def _holdout(n: int, k: int, seed: int) -> list[int]:
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7)).tolist()[:k])


def _prepare(cfg: DataConfig, dataset, split: str, tokenizer, seed: int) -> PromptSet:
    if cfg.rename_columns:
        missing = [c for c in cfg.rename_columns if c not in dataset.column_names]
        if missing:
            raise UserError(
                f"data.rename_columns names {', '.join(missing)}, not a column of {cfg.dataset!r} "
                f"(columns: {', '.join(dataset.column_names)})"
            )
        kept = [c for c in dataset.column_names if c not in cfg.rename_columns]
        targets = list(cfg.rename_columns.values())
        clashes = sorted({t for t in targets if t in kept or targets.count(t) > 1})
        if clashes:
            raise UserError(
                f"data.rename_columns = {cfg.rename_columns}: two columns would be named "
                f"{', '.join(clashes)} (columns: {', '.join(dataset.column_names)}); rename "
                "the existing one too, or choose another name"
            )
        dataset = dataset.rename_columns(cfg.rename_columns)
    columns = dataset.column_names
    if cfg.query_column not in columns:
        raise UserError(
            f"data.query_column = {cfg.query_column!r}: no such column in {cfg.dataset!r} "
            f"split {split!r} (columns: {', '.join(columns)})"
        )
    missing = (template_fields(cfg.prompt_template) or set()) - {"query", *columns}
    if missing:
        raise UserError(
            f"data.prompt_template uses {', '.join(sorted(missing))}, which is not a column "
            f"of {cfg.dataset!r} (columns: {', '.join(columns)})"
        )
    table = dataset.to_dict()
    queries = [_query_text(q, i, cfg, split) for i, q in enumerate(table[cfg.query_column])]
    if cfg.min_query_chars:
        keep = [i for i, q in enumerate(queries) if len(q) > cfg.min_query_chars]
        queries = [queries[i] for i in keep]
        table = {k: [v[i] for i in keep] for k, v in table.items()}
    if not queries:
        raise UserError(f"data.dataset = {cfg.dataset!r}: split {split!r} has no usable rows")
    if cfg.query_max_tokens:
        queries = _token_prefixes(queries, tokenizer, cfg, seed)
    prompts = PromptSet(queries, table)
    _check_formatting(cfg, prompts, tokenizer)
    return prompts


def _query_text(value, row: int, cfg: DataConfig, split: str) -> str:
    """A query is text (a number is taken as its digits); anything else would become prompt text
    such as "None" or "['5+22=']" without a word."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return str(value)
    raise UserError(
        f"data.query_column = {cfg.query_column!r}: row {row} of {cfg.dataset!r} split "
        f"{split!r} holds {_kind(value)} {str(value)[:60]!r}, not text; fix or drop such rows "
        "(or choose another data.query_column)"
    )


def _kind(value) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _check_formatting(cfg: DataConfig, prompts: PromptSet, tokenizer) -> None:
    """Format every prompt once now (cheap), so that a template that does not fit a row, or a
    chat template the tokenizer cannot apply, fails before training rather than in it."""
    for i, (query, row) in enumerate(zip(prompts.queries, prompts.rows(), strict=True)):
        try:
            text = format_prompt(cfg.prompt_template, query, row)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise UserError(
                f"data.prompt_template = {cfg.prompt_template!r} cannot format row {i} "
                f"({type(e).__name__}: {e})"
            ) from None
    if cfg.chat_template and tokenizer is not None and len(prompts):
        try:
            render(tokenizer, cfg, text)
        except Exception as e:  # jinja errors, or no template at all
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"data.chat_template = true, but the tokenizer cannot apply its chat template: "
                f"{reason}"
            ) from None


def _token_prefixes(texts: list[str], tokenizer, cfg: DataConfig, seed: int) -> list[str]:
    """The first n tokens of each text, n ~ U[query_min_tokens, query_max_tokens) (seeded)."""
    rng = random.Random(seed)
    lengths = [rng.randrange(cfg.query_min_tokens, cfg.query_max_tokens) for _ in texts]
    # A generous character prefix tokenises like the full text over its first tokens, and
    # keeps this cheap on 25k long reviews.
    heads = [t[: 50 * cfg.query_max_tokens] for t in texts]
    ids = tokenizer(heads, add_special_tokens=False).input_ids
    return [tokenizer.decode(i[:n]) for i, n in zip(ids, lengths, strict=True)]


def _load_split(cfg: DataConfig, split: str):
    import datasets

    datasets.disable_progress_bars()
    # datasets logs its own version of a file's damage before raising; ours is the one message
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    path = Path(cfg.dataset)
    key = f"data.dataset = {cfg.dataset!r}"
    loaded = None
    try:
        if path.is_file():
            if path.stat().st_size == 0:
                raise UserError(f"{key}: the file is empty")
            builder = DATA_FILE_BUILDERS.get(path.suffix)
            if builder is None:
                kinds = ", ".join(DATA_FILE_BUILDERS)
                raise UserError(f"{key}: unsupported file type (use {kinds})")
            check_data_file(path, key)
            # A single file is one split, whatever its name: it is the split asked for.
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if not path.exists() and (
            path.suffix in DATA_FILE_BUILDERS or cfg.dataset.startswith(("/", "./", "../", "~"))
        ):
            relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise UserError(f"{key}: no such file or directory{relative}")
        if path.is_dir() and path.suffix in DATA_FILE_BUILDERS:
            check_data_file(path, key)  # a directory named like a data file: say so
        if path.is_dir():
            files = split_files(path, split)
            for file in files:
                check_data_file(file, key)
            if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
                loaded = datasets.load_from_disk(str(path))
                return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            if files and len({f.suffix for f in files}) == 1:
                # The split's own files, by name: datasets' inference from file names would read
                # test_id.jsonl and test_ood.jsonl together as one "test" split.
                builder = DATA_FILE_BUILDERS[files[0].suffix]
                named = [str(f) for f in files]
                return datasets.load_dataset(builder, data_files=named, split="train")
            return datasets.load_dataset(str(path), split=split)
        return datasets.load_dataset(cfg.dataset, cfg.config_name or None, split=split)
    except UserError:
        raise
    except KeyError:
        names = (
            f" (splits: {', '.join(loaded)})" if isinstance(loaded, datasets.DatasetDict) else ""
        )
        raise UserError(f"{key}: has no split {split!r}{names}") from None
    except Exception as e:  # datasets raises many types: not found, offline, bad split, bad file
        if type(e).__name__ == "DatasetGenerationError" and e.__cause__ is not None:
            e = e.__cause__  # what was wrong with the file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "corresponds to no data" in reason:
            raise UserError(f"{key}: split {split!r} has no rows") from None
        known = re.search(r"Unknown split \"[^\"]*\"\. Should be one of \[(.*)\]", reason)
        if known:
            names = known.group(1).replace("'", "")
            raise UserError(f"{key}: has no split {split!r} (splits: {names})") from None
        raise UserError(f"{key} (split {split!r}) could not be loaded: {reason}") from None


def format_prompt(template: str, query: str, row: dict) -> str:
    return template.format_map({**row, "query": query})


def render(tokenizer, cfg: DataConfig, content: str) -> str:
    """The text the model sees: `content` itself, or a chat built with the tokenizer's template."""
    if not cfg.chat_template:
        return content
    messages = [{"role": "user", "content": content}]
    if cfg.system_prompt:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(
    tokenizer, texts: list[str], max_tokens: int, chat: bool = False
) -> tuple[list[list[int]], int]:
    """Token ids per prompt, and how many were cut. Long prompts keep their *last* tokens (the
    question's end and the answer cue), after the BOS token when there is one. Chat-templated
    texts already hold their special tokens, so none are added."""
    encoded = tokenizer(texts, add_special_tokens=not chat).input_ids
    bos = tokenizer.bos_token_id
    out, cut = [], 0
    for ids in encoded:
        if len(ids) > max_tokens:
            cut += 1
            keep_bos = bos is not None and ids[0] == bos
            ids = [bos, *ids[len(ids) - max_tokens + 1 :]] if keep_bos else ids[-max_tokens:]
        out.append(ids)
    return out, cut


class PromptOrder:
    """A seeded shuffle of the prompt indices, reshuffled each pass; its position is its state."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.position = n, seed, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def next(self, k: int) -> list[int]:
        picked: list[int] = []
        while len(picked) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            take = min(k - len(picked), self.n - self.position)
            picked += self._order[self.position : self.position + take]
            self.position += take
        return picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shuffle()

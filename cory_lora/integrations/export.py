"""`cory-lora export`: one agent of a finished run, as a PEFT adapter or a merged model, with a
model card; optionally uploaded to the Hugging Face Hub.

* Adapter (default): `adapter_config.json` + `adapter_model.safetensors` (what
  `PeftModel.from_pretrained(base, DIR)` loads), the agent's `value_head.safetensors`, and
  `README.md`, a model card with front matter (`base_model`, `library_name: peft`, tags), the
  recipe, and the run's eval.json figures when it has them.
* Merged (`merge=True`): a plain transformers model (`AutoModelForCausalLM.from_pretrained(DIR)`)
  in the base's own dtype (its config.json's), with the tokenizer, the value head and the card.
  The LoRA update is added to the base weights the agent was trained on: for a 4-bit run, the
  NF4 base *dequantised* (not the original full-precision weights, which the adapter never saw),
  so the merged model computes what the trained agent computed.

The output is built in a temporary directory beside DIR and renamed into place: DIR is either
whole or absent. An existing DIR is never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

from cory_lora.config import Recipe, load_recipe
from cory_lora.engine.model import (
    VALUE_HEAD_FILE,
    check_model_path,
    looks_like_a_path,
    read_model_config,
)
from cory_lora.errors import UserError, environment_error, first_line, os_error_message
from cory_lora.run.atomic import atomic_directory
from cory_lora.run.records import read_json, read_metrics
from cory_lora.science.evaluate import samples_each
from cory_lora.services import fetch
from cory_lora.services.distributed import cli

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", VALUE_HEAD_FILE)


def export_agent(
    run_dir: Path,
    agent: str,
    out: Path,
    merge: bool = False,
    device: str = "cpu",
) -> Path:
    """Write agent `agent` of the run in `run_dir` to the new directory `out`; return `out`."""
    run_dir, out = Path(run_dir), Path(out)
    recipe = _finished_run(run_dir)
    if agent not in recipe.agent_names:
        raise UserError(f"--agent {agent!r}: this run has {', '.join(recipe.agent_names)}")
    adapter = run_dir / "final" / agent
    expected = ADAPTER_FILES if recipe.ppo.advantage == "gae" else ADAPTER_FILES[:2]
    missing = [name for name in expected if not (adapter / name).is_file()]
    if missing:
        raise UserError(f"{adapter} is incomplete (missing {', '.join(missing)})")
    _check_adapter(run_dir, adapter)
    if out.exists():
        raise UserError(
            f"output directory {str(out)!r} already exists; choose another -o (export never "
            "overwrites)"
        )
    try:
        _write_export(recipe, run_dir, adapter, agent, out, merge, device)
    except Exception as error:  # safetensors and torch wrap a full disk in their own types
        e = environment_error(error)
        if e is None:
            raise
        raise UserError(
            os_error_message(e, f"the export {out} could not be written")
            + f"; nothing was written there, and the run {run_dir} is intact. Once that is "
            "fixed (or with -o on another disk), export again"
        ) from None
    return out


def _write_export(
    recipe: Recipe, run_dir: Path, adapter: Path, agent: str, out: Path, merge: bool, device: str
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as tmp:  # built beside `out`, renamed into place when whole
        if merge:
            dtype = _write_merged(recipe, adapter, tmp, device)
        else:
            for name in ADAPTER_FILES[:2]:  # the value head is copied below, in both forms
                shutil.copy2(adapter / name, tmp / name)
            dtype = None
        if recipe.ppo.advantage == "gae":  # critic-free agents have no value head
            shutil.copy2(adapter / VALUE_HEAD_FILE, tmp / VALUE_HEAD_FILE)
        card = model_card(recipe, run_dir, agent, merged=merge, dtype=dtype)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        _shareable(tmp)


def _check_adapter(run_dir: Path, adapter: Path) -> None:
    """Refuse to export an adapter whose files would not load: a config that is not PEFT's LoRA
    JSON, weights whose safetensors header is damaged."""
    from safetensors import safe_open

    config = adapter / "adapter_config.json"
    problem = None
    try:
        if read_json(config).get("peft_type") != "LORA":
            problem = f"{config} is not a LoRA config"
    except UserError as e:
        problem = str(e)
    for name in ADAPTER_FILES[1:]:
        try:
            if (adapter / name).is_file():
                with safe_open(str(adapter / name), framework="pt") as weights:
                    weights.keys()
        except Exception as e:  # safetensors' header errors have no common type
            problem = problem or f"{adapter / name} is damaged ({first_line(e)})"
    if problem:
        raise UserError(
            f"{problem}; nothing was exported. The run's checkpoints are intact: delete "
            f"{run_dir / 'final'} and `{cli('resume', run_dir)}` writes it again"
        )


def _shareable(directory: Path) -> None:
    """Ordinary permissions (the umask's), not the owner-only ones of temporary files."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _finished_run(run_dir: Path) -> Recipe:
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{str(run_dir)!r} is not a run directory (no config.toml)")
    if not (run_dir / "final").is_dir():
        raise UserError(
            f"{str(run_dir)!r}: the run has not finished (no final/ adapters); finish it with "
            f"`{cli('resume', run_dir)}`, then export"
        )
    return load_recipe(run_dir / "config.toml")


def base_dtype(recipe: Recipe):
    """The dtype the base checkpoint is stored in (its config.json), float32 when unstated."""
    import torch

    config = read_model_config(recipe.model, "the base's config to merge into it")
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _write_merged(recipe: Recipe, adapter: Path, out: Path, device: str):
    """Base (dequantised when the run was 4-bit) + the merged LoRA update, saved to `out`."""
    from peft import PeftModel

    from cory_lora.engine.model import load_base_model, load_tokenizer

    check_model_path(recipe.model)
    dtype = base_dtype(recipe)
    # Load the base as training did (4-bit stays 4-bit: the adapter was trained on those
    # weights), but with the base's own dtype for everything that is not quantised.
    name = str(dtype).removeprefix("torch.")
    changes = {"dtype": name, "device": device, "gradient_checkpointing": False}
    base = load_base_model(recipe.model.model_copy(update=changes))
    if recipe.model.load_in_4bit:
        base = base.dequantize(dtype=dtype)
    model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    model = model.to(dtype)
    model.config.use_cache = True
    model.save_pretrained(str(out))
    load_tokenizer(recipe.model).save_pretrained(str(out))
    return dtype


# --------------------------------------------------------------------------- the model card


def _card_base(recipe: Recipe) -> str:
    """The base a model card names: a fetched model by its hub id (where its weights come
    from), anything else as the recipe names it."""
    name = recipe.model.name_or_path
    if fetch.is_fetched_name(name) and not fetch.unknown_name_problem(name):
        return fetch.MODELS[name.removeprefix(fetch.PREFIX)].hub_id
    return name


def _front_matter(recipe: Recipe, merged: bool) -> str:
    base = _card_base(recipe)
    tags = ["cory-lora", "cory", "ppo", "reinforcement-learning", "lora"]
    tags += ["merged"] if merged else ["peft"]
    lines = ["---"]
    if not looks_like_a_path(base) and not Path(base).exists():  # a hub id: the Hub links it
        lines.append(f"base_model: {json.dumps(base)}")
    lines.append(f"library_name: {'transformers' if merged else 'peft'}")
    lines.append("pipeline_tag: text-generation")
    lines.append("tags:")
    lines += [f"- {tag}" for tag in tags]
    dataset = recipe.data.dataset
    if not looks_like_a_path(dataset) and not Path(dataset).exists():
        lines += ["datasets:", f"- {json.dumps(dataset)}"]
    lines.append("---")
    return "\n".join(lines)


def _eval_table(run_dir: Path) -> str:
    path = run_dir / "eval.json"
    if not path.is_file():
        return "No evaluation yet (`cory-lora eval RUN_DIR` writes eval.json).\n"
    result = read_json(path)
    ks = result.get("k", [])
    header = ["row", "accuracy", *[f"pass@{k}" for k in ks], "task reward", "KL"]
    header.append(f"task − {result.get('eta')}·KL")
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        f"`cory-lora eval` on {result.get('prompts')} {result.get('split')} prompts, "
        f"{samples_each(result.get('samples_per_prompt'))} (accuracy: greedy):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result.get("rows", []):
        passes = [fmt(row.get("pass_at", {}).get(str(k))) for k in ks]
        cells = [row["name"], fmt(row.get("accuracy")), *passes]
        cells += [fmt(row.get("task_reward")), fmt(row.get("kl")), fmt(row.get("combined_reward"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _training_summary(run_dir: Path, agent: str) -> str:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return ""
    rows = read_metrics(path)
    if not rows:
        return ""

    def mean(window, key):
        values = [r[key] for r in window if r.get(key) is not None]
        return f"{sum(values) / len(values):.3f}" if values else "–"

    n = min(10, len(rows))
    reward = f"{agent}/task_reward"
    return (
        f"Training: {len(rows)} iterations; {agent}'s mean task reward {mean(rows[:n], reward)} "
        f"over the first {n}, {mean(rows[-n:], reward)} over the last {n} (sequence KL to the "
        f"base {mean(rows[-n:], f'{agent}/kl')}).\n"
    )


def model_card(recipe: Recipe, run_dir: Path, agent: str, merged: bool = False, dtype=None) -> str:
    """The README.md of agent `agent` of the run in `run_dir`, exported as an adapter or (merged)
    as a full model in `dtype`: front matter, what the agent is, how to load it, the run's
    results and its recipe."""
    base = _card_base(recipe)
    form, use = _form_and_use(recipe, base, merged, dtype)
    config = (run_dir / "config.toml").read_text(encoding="utf-8").strip()
    lines = [
        _front_matter(recipe, merged),
        "",
        f"# {run_dir.name} · {agent}",
        "",
        f"Agent `{agent}` of a cory-lora run — {_algorithm(recipe)} — on `{base}`, exported as "
        f"{form}. Task reward: `{recipe.reward.function}` on `{recipe.data.dataset}`.",
        "",
        (
            "`value_head.safetensors` holds the agent's value head (a linear layer on the last "
            "hidden state), for continuing RL; generation does not need it."
            if recipe.ppo.advantage == "gae"
            else f"Trained critic-free (`ppo.advantage = {recipe.ppo.advantage}`): no value head."
        ),
        "",
        "## Use",
        "",
        use,
        "Prompts as in training: "
        + ("the tokenizer's chat template, " if recipe.data.chat_template else "")
        + f"template `{recipe.data.prompt_template!r}`.",
        "",
        "## Results",
        "",
        _eval_table(run_dir),
        _training_summary(run_dir, agent),
        "## Recipe",
        "",
        "```toml",
        config,
        "```",
        "",
    ]
    return "\n".join(lines)


def _algorithm(recipe: Recipe) -> str:
    if recipe.train.algorithm != "cory":
        return "single-agent PPO"
    return (
        "CORY ([Ma et al., NeurIPS 2024](https://arxiv.org/abs/2410.06101)): two LoRA agents "
        "on one shared base "
        "exchange the pioneer and observer roles and are paid the collective task reward minus "
        "their own KL to the base"
    )


def _form_and_use(recipe: Recipe, base: str, merged: bool, dtype) -> tuple[str, str]:
    """What the export is (a phrase) and the model card's "Use" section: how to load it, and,
    for a fetched base, how the weights it was trained on differ from the hub's."""
    if merged:
        form = (
            f"a merged model ({str(dtype).removeprefix('torch.')}): the base "
            + (
                "dequantised from the 4-bit NF4 weights it was trained on "
                if recipe.model.load_in_4bit
                else ""
            )
            + "with the agent's LoRA update added"
        )
        use = (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'model = AutoModelForCausalLM.from_pretrained("THIS_DIR_OR_REPO")\n'
            'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR_OR_REPO")\n```\n'
        )
    else:
        form = "a PEFT LoRA adapter"
        use = (
            "```python\nfrom peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM\n\n"
            f"base = AutoModelForCausalLM.from_pretrained({json.dumps(base)})\n"
            'model = PeftModel.from_pretrained(base, "THIS_DIR_OR_REPO")\n```\n'
        )
    if base != recipe.model.name_or_path:
        use += (
            f"Trained on `{recipe.model.name_or_path}`: {base}'s weights as cory-lora fetches "
            "them from a package registry (dequantised from a Q4_1 GGUF), so the original hub "
            "weights differ from the trained-on base by that quantisation error.\n"
        )
    return form, use


# --------------------------------------------------------------------------- the Hub


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Upload an exported directory to the Hub (needs `huggingface-cli login` or HF_TOKEN).
    Returns the repository URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=f"cory-lora export of {Path(folder).name}",
        )
    except Exception as e:  # no network, no token, no permission: one message, the export stays
        again = shlex.join(["huggingface-cli", "upload", repo_id, str(folder)])
        raise UserError(
            f"--push-to-hub {repo_id!r} failed ({first_line(e)}); the export is complete in "
            f"{folder}. {push_advice(e, repo_id)}, then push it with `{again}`"
        ) from None
    return str(url)


def check_repo_id(repo_id: str) -> None:
    """A Hub repository id that cannot exist is refused before anything is written."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problem = None
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        problem = first_line(e)
    if problem is None and repo_id.count("/") != 1:
        problem = "expected user/name or organisation/name"
    if problem:
        raise UserError(f"--push-to-hub {repo_id!r}: not a Hub repository id ({problem})")


def push_advice(error: Exception, repo_id: str) -> str:
    """What to do about a failed push, by its cause."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set in this shell: unset it where the Hub is reachable"
    if type(error).__name__ == "LocalTokenNotFoundError":
        return "Log in with `huggingface-cli login` (or set HF_TOKEN)"
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is None:  # "401 Client Error: Unauthorized for url ..." from older clients
        found = re.search(r"\b([45]\d\d) (?:Client|Server) Error", str(error))
        status = int(found.group(1)) if found else None
    if status == 401:
        return "The Hub did not accept your token: log in again (`huggingface-cli login`)"
    if status == 403:
        owner = repo_id.split("/")[0]
        return (
            f"Your token may not write to {owner!r}: use a token with write access, and a "
            "namespace you own or belong to"
        )
    if status == 404:
        return f"The Hub has no namespace {repo_id.split('/')[0]!r} for you: check the name"
    if isinstance(status, int) and status >= 500:
        return "The Hub had a problem of its own: try again later"
    if (
        isinstance(error, (ConnectionError, TimeoutError, OSError))
        or "connect" in str(error).lower()
    ):
        return (
            "The Hub cannot be reached from here (no network, a proxy?): push from a machine "
            "that reaches it"
        )
    return "Check the message above"

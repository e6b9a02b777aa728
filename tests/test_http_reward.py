"""The HTTP reward against a real local server (127.0.0.1, a free port, started and stopped by
each test): batching, retries after transient failures, clear errors, and a training run."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from cory_lora.cli import app
from cory_lora.config import RewardConfig
from cory_lora.errors import ConfigError, RewardError, UserError
from cory_lora.rewards import http as http_module
from cory_lora.rewards import load_reward

from .conftest import tiny_recipe_dict
from .helpers import write_recipe


class RewardServer:
    """A local reward server. `script` is a list of answers, one per request, each
    (status, body) or "sleep" (answer late); after it runs out: 1.0 per completion equal to its
    `answer` column, else 0.0 (a list, or {"rewards": ...} when `wrapped`)."""

    def __init__(self, script=(), wrapped=False):
        self.script, self.wrapped, self.requests = list(script), wrapped, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers["Content-Length"])
                payload = json.loads(self.rfile.read(length))
                server.requests.append(payload)
                step = server.script.pop(0) if server.script else None
                if step == "sleep":
                    server.release.wait(5)
                    step = None
                if step is None:
                    answers = payload["columns"].get("answer", [None] * len(payload["prompts"]))
                    pairs = zip(payload["completions"], answers, strict=True)
                    rewards = [float(c.strip() == str(a)) for c, a in pairs]
                    step = (200, {"rewards": rewards} if server.wrapped else rewards)
                status, body = step
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep the test output clean
                pass

        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(http_module, "RETRY_WAIT_S", 0.0)


def reward_for(url, **keys):
    return load_reward(RewardConfig(function="http_reward", url=url, **keys))


def test_completions_go_in_batches_with_their_columns_and_rewards_come_back():
    with RewardServer(wrapped=True) as server:
        reward = reward_for(server.url, batch_size=2)
        prompts = [f"{i}+1=" for i in range(5)]
        answers = [str(i + 1) for i in range(5)]
        completions = ["1", "3", "3", "0", " 5 "]
        out = reward(prompts, completions, {"answer": answers, "question": prompts})
    assert out.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [len(r["completions"]) for r in server.requests] == [2, 2, 1]
    assert server.requests[1] == {
        "prompts": ["2+1=", "3+1="],
        "completions": ["3", "0"],
        "columns": {"answer": ["3", "4"], "question": ["2+1=", "3+1="]},
    }


def test_a_bare_list_and_nulls_are_accepted():
    with RewardServer(script=[(200, [0.5, None])]) as server:
        out = reward_for(server.url)(["p", "p"], ["a", "b"], {})
    assert out[0] == 0.5 and out[1].isnan()  # None: no score, the loop skips that update


def test_server_errors_and_timeouts_are_tried_again():
    script = [(503, "busy"), (500, "oops"), (200, [0.25])]
    with RewardServer(script=script) as server:
        assert reward_for(server.url, retries=2)(["p"], ["a"], {}).tolist() == [0.25]
    assert len(server.requests) == 3
    with RewardServer(script=["sleep", (200, [0.75])]) as server:
        out = reward_for(server.url, retries=1, timeout_s=0.3)(["p"], ["a"], {})
    assert out.tolist() == [0.75]


@pytest.mark.parametrize(
    ("script", "retries", "message", "requests"),
    [
        (
            [(500, "database down")] * 3,
            2,
            r"answered HTTP 500 .*database down \(gave up after 3",
            3,
        ),
        ([(404, "no such path")], 2, r"answered HTTP 404 Not Found: no such path$", 1),
        ([(200, "<html>")], 0, "answered HTTP 200 with something that is not JSON", 1),
        ([(200, {"score": 1})], 0, r"expected a JSON list of numbers", 1),
        ([(200, [1.0])], 0, "answered 1 rewards for 2 completions", 1),
        (["sleep"], 0, r"did not answer within reward.timeout_s = 0.3 s \(gave up after 1 att", 1),
    ],
)
def test_bad_answers_fail_clearly_naming_the_url(script, retries, message, requests):
    with RewardServer(script=script) as server:
        reward = reward_for(server.url, retries=retries, timeout_s=0.3)
        with pytest.raises(RewardError, match=message) as caught:
            reward(["p", "p"], ["a", "b"], {})
    assert f"reward.url = '{server.url}'" in str(caught.value)
    assert len(server.requests) == requests


def test_a_server_that_is_not_there_fails_after_the_retries():
    with RewardServer() as server:
        url = server.url
    with pytest.raises(RewardError, match=r"cannot connect .*gave up after 2 attempts"):
        reward_for(url, retries=1)(["p"], ["a"], {})


def test_the_trial_call_before_training_reaches_the_server():
    with RewardServer(script=[(401, "bad token")]) as server:
        reward = reward_for(server.url)
        with pytest.raises(UserError, match=r"HTTP 401 .* \(in a trial call"):
            reward.probe(["p"], {})


def test_the_recipe_needs_an_http_url(tiny_recipe):
    with pytest.raises(ConfigError) as caught:
        tiny_recipe(reward={"function": "http_reward"})
    assert 'reward.url: required by reward.function = "http_reward"' in str(caught.value)
    with pytest.raises(ConfigError, match="expected an http:// or https:// URL"):
        tiny_recipe(reward={"function": "http_reward", "url": "localhost:8000"})


def test_a_cory_run_scores_through_the_server(tmp_path, tiny_model_dir, arith_file):
    with RewardServer() as server:
        raw = tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            reward={"function": "http_reward", "url": server.url, "batch_size": 3},
        )
        recipe = write_recipe(tmp_path / "recipe.toml", raw)
        out = tmp_path / "run"
        result = CliRunner().invoke(app, ["run", str(recipe), "--output-dir", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # probe (2 prompts) + 2 iterations x 2 agents x 8 completions in batches of 3
    assert len(server.requests) == 1 + 2 * 2 * 3
    assert all(len(r["completions"]) <= 3 for r in server.requests)

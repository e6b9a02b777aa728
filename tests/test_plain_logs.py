"""Logs without a terminal (nohup, Docker without -t, a pipe): whole plain lines, one per
iteration or per log.plain_every_s seconds, never cut at 80 columns; the live view on a TTY only."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from cory_lora.cli import console as console_module
from cory_lora.cli.console import PLAIN_WIDTH, Display, make_console

from .conftest import tiny_recipe_dict
from .helpers import write_recipe

NAMES = ("llm1", "llm2")


def metrics(iteration: int) -> dict:
    return {
        "iteration": iteration,
        "llm1/role": "pioneer",
        "llm1/task_reward": 0.123456,
        "llm1/kl": 0.5,
        "llm2/role": "observer",
        "llm2/task_reward": 0.25,
        "llm2/kl": None,
    }


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=PLAIN_WIDTH, soft_wrap=True), out


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_every_iteration_gets_one_whole_line(monkeypatch):
    console, out = plain_console()
    display = Display(console)
    assert not display.live
    display.start(total=3)
    for i in (1, 2, 3):
        display.update(metrics(i), NAMES, 3)
    display.stop()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("iteration 1/3 (")
    assert lines[2].startswith("iteration 3/3 (")
    for line in lines:
        assert line.endswith(
            "llm1 (pioneer) reward 0.123 kl 0.500 | llm2 (observer) reward 0.250 kl n/a"
        )


def test_plain_every_s_thins_the_lines_but_keeps_the_first_and_the_last(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(console_module.time, "monotonic", clock)
    console, out = plain_console()
    display = Display(console, plain_every_s=10.0)
    display.start(total=8)
    for i in range(1, 9):
        clock.now += 4.0  # 4 s per iteration: lines at 4 s, then >= 10 s later: 16 s, 28 s
        display.update(metrics(i), NAMES, 8)
    printed = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()]
    assert printed == [1, 4, 7, 8]  # and the last one, whenever it comes
    assert "iteration 4/8 (16s, eta 16s)" in out.getvalue()


def test_the_live_view_needs_a_terminal_and_no_quiet():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100)
    assert Display(terminal).live
    assert not Display(terminal, quiet=True).live
    assert not Display(Console(file=io.StringIO(), force_terminal=False)).live


def test_the_cli_console_does_not_wrap_at_80_columns_in_a_pipe():
    code = (
        "from cory_lora.cli.console import make_console; c = make_console(); "
        "c.print('x' * 300); c.print('[bold]ok[/] ' + 'y ' * 100)"
    )
    env = {**os.environ, "COLUMNS": "40"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert out.splitlines() == ["x" * 300, "ok " + "y " * 100]
    assert make_console().width == PLAIN_WIDTH  # pytest captures stdout: not a terminal


def test_a_run_piped_to_a_file_logs_every_iteration_on_one_line(
    tmp_path, tiny_model_dir, arith_file
):
    recipe = write_recipe(
        tmp_path / "recipe.toml",
        tiny_recipe_dict(tiny_model_dir, arith_file, train={"iterations": 2}),
    )
    log = tmp_path / "nohup.out"
    with open(log, "w") as f:  # what nohup does: stdout is a file
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cory_lora.cli",
                "run",
                str(recipe),
                "--output-dir",
                str(tmp_path / "run"),
            ],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "40"},
        )
    assert result.returncode == 0, result.stderr[-2000:]
    text = log.read_text()
    assert "\x1b[" not in text  # no colour codes, no cursor movement
    lines = [line for line in text.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    for line in lines:
        assert len(line) > 80
        assert "llm1 (" in line and "llm2 (" in line

"""The CLI's conventions, as users of torchrun, TRL and torchtune expect them: `--version`,
plain `--help` on every command (flags without type tags), flags that are flags."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from cory_lora.cli import app

from .helpers import invoke

COMMANDS = sorted(command.name or command.callback.__name__ for command in app.registered_commands)


def test_version_prints_the_installed_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"cory-lora {version('cory-lora')}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_and_names_no_types_of_flags(command):
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "╭" not in result.output
    assert "--help  " in result.output.replace("--help ", "--help  ")


def test_launch_options_are_on_the_training_commands():
    for command in ("run", "resume", "study"):
        assert "--nproc-per-node" in invoke(command, "--help").output, command
    for command in ("run", "resume"):
        out = invoke(command, "--help").output
        assert all(o in out for o in ("--nnodes", "--node-rank", "--rdzv-endpoint")), command


@pytest.mark.parametrize("terminal", [True, False])
def test_user_text_in_a_study_display_is_printed_literally(terminal):
    """Run ids hold grid values as written, e.g. a chat template's [/INST]: never rich markup."""
    from types import SimpleNamespace

    from rich.console import Console

    from cory_lora.cli.console import StudyDisplay

    console = Console(record=True, force_terminal=terminal, width=200)
    run = SimpleNamespace(id="arm/data.prompt_template=[/INST] [bold]{query}/seed-0", iterations=2)
    display = StudyDisplay(console)
    display.start([run], {})
    display.begin(run, "fresh")
    display.progress(run, 1)
    display.end(run, {"status": "failed", "error": "[/x] went wrong"})
    display.stop()
    out = console.export_text()
    assert "[/INST] [bold]{query}" in out and "[/x] went wrong" in out

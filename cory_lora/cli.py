"""`cory-lora`: a thin shell. Parse, load and validate the recipe, print it, call the library.

User errors (`UserError`) print one message and exit non-zero without a traceback (recipe
problems exit 2); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cory_lora.config import describe_keys, load_recipe, to_toml
from cory_lora.errors import UserError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="CORY: two LoRA agents on one shared (4-bit) base model learn a task together with PPO.",
)
console = Console()
error_console = Console(stderr=True)

RecipeArg = Annotated[Path, typer.Argument(help="Recipe TOML file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a recipe key: section.key=value (TOML value). Repeatable."
    ),
]


@contextmanager
def user_errors():
    """Turn a UserError into one red message and its exit code."""
    try:
        yield
    except UserError as e:
        error_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None


def quiet_libraries() -> None:
    """Keep library chatter (progress bars, deprecation notes) out of the user's terminal."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@app.command()
def run(
    recipe: RecipeArg,
    set_: SetOpt = None,
    output_dir: Annotated[
        Path | None,
        typer.Option(help="Run directory (default: train.output_dir or runs/<recipe>-<time>)."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing run in the output directory.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option(help="Plain log lines instead of the progress display.")
    ] = False,
) -> None:
    """Train with a recipe."""
    from cory_lora.console import Display

    with user_errors():
        config = load_recipe(recipe, set_ or [])
        from cory_lora.outputs import RunDir
        from cory_lora.train import default_output_dir

        path = output_dir or Path(config.train.output_dir or default_output_dir(recipe))
        run_dir = RunDir(path, overwrite=overwrite)  # checks now, before the model loads
        console.print(f"[bold]recipe[/] {recipe} -> [bold]{path}[/]", highlight=False)
        console.print(to_toml(config), highlight=False, markup=False)
        quiet_libraries()
        from cory_lora.train import run as train_run

        train_run(config, run_dir, Display(console, quiet=quiet))


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe (types, ranges, consistency) without loading any model."""
    with user_errors():
        config = load_recipe(recipe, set_ or [])
    console.print(to_toml(config), highlight=False, markup=False)
    console.print(f"[green]ok[/]: {recipe} is a valid recipe", highlight=False)


@app.command()
def keys() -> None:
    """Print every recipe key with its default and meaning (Markdown)."""
    typer.echo(describe_keys())


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())

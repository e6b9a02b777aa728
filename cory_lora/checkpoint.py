"""Checkpoints: everything a run's future depends on, written so that none is ever half-there.

A checkpoint is the directory `checkpoints/iter-NNNNNN/` (NNNNNN = iterations completed):

    llm1/, llm2/            PEFT adapters + value heads (safetensors)
    optimizer-llmK.pt       each agent's AdamW state (loaded with torch.load(weights_only=True))
    rng.pt                  torch generators: sampling, minibatch order, global CPU (and CUDA)
    logs/                   metrics.jsonl and samples.jsonl up to this iteration: a resume
                            restores the logs from them, mending any line damaged since
    state.json              iteration, data order, KL coefficients, score statistics, skip
                            counters, Python and NumPy RNG states, and a SHA-256 of every file

It is built under a temporary name, every file fsynced, then renamed into place and the parent
directory fsynced: a reader sees a whole checkpoint or none. The last `train.keep_checkpoints`
are kept. Loading verifies every checksum, so a damaged file is reported, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cory_lora import faults
from cory_lora.config import Recipe, load_recipe, resume_differences
from cory_lora.data import PromptOrder
from cory_lora.errors import ENVIRONMENT_ERRNOS, UserError, os_error_message
from cory_lora.model import Agents
from cory_lora.outputs import LOG_SNAPSHOT, RunDir, fsync_tree, snapshot_logs
from cory_lora.update import AgentState

CHECKPOINTS = "checkpoints"
FORMAT = 1


@dataclass
class TrainerState:
    """What the training loop carries from one iteration to the next, besides the weights."""

    iteration: int  # iterations completed
    order: PromptOrder
    agents: dict[str, AgentState]
    sampling_rng: torch.Generator
    minibatch_rng: torch.Generator
    bad_streak: dict[str, int] = field(default_factory=dict)  # consecutive skipped updates
    skipped: dict[str, int] = field(default_factory=dict)  # skipped updates in the whole run


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def completed(checkpoint: Path) -> int:
    """Iterations completed at a checkpoint, from its name (-1 for a name that is not ours)."""
    try:
        return int(Path(checkpoint).name.removeprefix("iter-"))
    except ValueError:
        return -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (temporary directories start with '.'), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter-"))


@dataclass(frozen=True)
class ResumeCheck:
    """What a resume will find, checked before anything is loaded or written."""

    done: int  # iterations completed at the newest checkpoint
    complete: bool  # the run already has its iterations and final/: nothing to do, touch nothing
    warning: str | None  # damage in the live logs that the resume mends from the checkpoint


def check_resume(run_dir: RunDir, recipe: Recipe) -> ResumeCheck:
    """Check a resume with `recipe` before it loads anything. Raises UserError when the recipe
    describes another run, when there is no checkpoint, when the newest one is past
    train.iterations (a resume cannot undo iterations, and training nothing while recording the
    lower count would falsify the record of what ran), or when the logs are damaged beyond what
    the checkpoint can mend."""
    refused, _ = resume_differences(load_recipe(run_dir.path / "config.toml"), recipe)
    if refused:
        raise UserError(
            f"cannot resume {run_dir.path} with a recipe that changed {', '.join(refused)}: "
            "that would be a different run (start a new one, or undo those changes)"
        )
    iterations = recipe.train.iterations
    checkpoints = list_checkpoints(run_dir.path)
    if not checkpoints and (run_dir.path / "final").is_dir():
        raise UserError(
            f"nothing to resume in {run_dir.path}: its checkpoints were deleted (final/ holds its "
            "adapters, but a resume needs a checkpoint's optimizer and random states); to train "
            "longer, start a new run"
        )
    if not checkpoints:
        raise UserError(
            f"nothing to resume in {run_dir.path}: it has no checkpoint (the run stopped before "
            "its first one); start it again with --overwrite"
        )
    done = completed(checkpoints[-1])
    if done > iterations:
        raise UserError(
            f"{run_dir.path} already has {done} iterations ({checkpoints[-1].name}); "
            f"train.iterations = {iterations} is fewer, and a resume cannot undo iterations. "
            "Nothing was changed: raise train.iterations to extend the run, or start a new one"
        )
    complete = done == iterations and (run_dir.path / "final").is_dir()
    return ResumeCheck(done, complete, None if complete else run_dir.check_logs(done))


def stopped_message(run_dir: Path, at_once: bool = True) -> str:
    """What a run stopped by Ctrl-C (during loading, or by a second Ctrl-C) leaves behind."""
    return ("stopped at once: " if at_once else "stopped: ") + what_is_left(run_dir)


def what_is_left(run_dir: Path) -> str:
    """For a run that stopped early: its last complete checkpoint and how to resume, or that
    there is nothing to resume."""
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        return (
            f"the last complete checkpoint, {checkpoints[-1].name}, is intact; resume with "
            f"`cory-lora resume {run_dir}`"
        )
    if (Path(run_dir) / "metrics.jsonl").exists():
        return (
            f"no checkpoint had been written yet, so there is nothing to resume; {run_dir} "
            "holds the log of the unfinished run: start again with --overwrite"
        )
    return "before training began; nothing was written"


def save_checkpoint(run_dir: Path, agents: Agents, state: TrainerState, keep: int) -> Path:
    """Write checkpoints/iter-NNNNNN/ atomically and drop the oldest beyond `keep`. A full disk
    (or another file-system failure) raises UserError; the older checkpoints stay intact."""
    try:
        return _save_checkpoint(Path(run_dir), agents, state, keep)
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        older = list_checkpoints(run_dir)
        kept = (
            f"the last complete checkpoint, {older[-1].name}, is intact"
            if older
            else ("no earlier checkpoint exists")
        )
        raise UserError(
            os_error_message(
                e, f"checkpoint {checkpoint_name(state.iteration)} could not be written"
            )
            + f"; {kept}. Once that is fixed: cory-lora resume {run_dir}"
        ) from None


def _save_checkpoint(run_dir: Path, agents: Agents, state: TrainerState, keep: int) -> Path:
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final = root / checkpoint_name(state.iteration)
    earlier = [p for p in list_checkpoints(run_dir) if completed(p) < state.iteration]
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}."))
    try:
        snapshot_logs(
            run_dir, state.iteration, tmp / LOG_SNAPSHOT, earlier[-1] if earlier else None
        )
        agents.save(tmp)
        for name, agent in state.agents.items():
            torch.save(agent.optimizer.state_dict(), tmp / f"optimizer-{name}.pt")
        rng = {
            "sampling": state.sampling_rng.get_state(),
            "minibatch": state.minibatch_rng.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        torch.save(rng, tmp / "rng.pt")
        faults.maybe_die("checkpoint")
        record = _record(state)
        record["files"] = {
            str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / "state.json").write_text(json.dumps(record))
        fsync_tree(tmp)
        if final.exists():  # the same iteration saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, agents: Agents, state: TrainerState) -> None:
    """Restore `agents` and `state` in place from checkpoint `path` (checksums verified first)."""
    path = Path(path)
    try:
        record = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise _corrupt(path, "state.json", str(e)) from None
    for name, digest in record.get("files", {}).items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise _corrupt(path, name, "missing or its checksum does not match")
    if record.get("format") != FORMAT or set(record["agents"]) != set(state.agents):
        raise _corrupt(path, "state.json", "written by another version or for other agents")
    try:
        agents.load(path, tuple(state.agents))
    except (RuntimeError, ValueError, KeyError) as e:  # e.g. config.toml edited to another shape
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {path} does not fit the run's recipe (was config.toml edited? model "
            f"and lora must stay as they were): {reason}"
        ) from None
    for name, agent in state.agents.items():
        optimizer_state = torch.load(
            path / f"optimizer-{name}.pt", weights_only=True, map_location="cpu"
        )
        agent.optimizer.load_state_dict(optimizer_state)
        saved = record["agents"][name]
        agent.kl_ctl.load_state_dict(saved["kl_ctl"])
        if agent.score_moments is not None and saved["score_moments"] is not None:
            agent.score_moments.load_state_dict(saved["score_moments"])
        state.bad_streak[name] = saved["bad_streak"]
        state.skipped[name] = saved["skipped"]
    rng = torch.load(path / "rng.pt", weights_only=True)
    state.sampling_rng.set_state(rng["sampling"])
    state.minibatch_rng.set_state(rng["minibatch"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    version, internal, gauss = record["python_random"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = record["numpy_random"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    state.order.load_state_dict(record["order"])
    state.iteration = record["iteration"]


def _record(state: TrainerState) -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "format": FORMAT,
        "iteration": state.iteration,
        "order": state.order.state_dict(),
        "agents": {
            name: {
                "kl_ctl": agent.kl_ctl.state_dict(),
                "score_moments": agent.score_moments.state_dict() if agent.score_moments else None,
                "bad_streak": state.bad_streak.get(name, 0),
                "skipped": state.skipped.get(name, 0),
            }
            for name, agent in state.agents.items()
        },
        "python_random": [version, list(internal), gauss],
        "numpy_random": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _corrupt(path: Path, name: str, reason: str) -> UserError:
    return UserError(
        f"checkpoint {path} is damaged ({name}: {reason}); delete that directory to resume from "
        "the one before it"
    )

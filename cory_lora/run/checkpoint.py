"""Checkpoints: everything a run's future depends on, written so that none is ever half-there.

A checkpoint is the directory `checkpoints/iter-NNNNNN/` (NNNNNN = iterations completed):

    llm1/, llm2/            PEFT adapters + value heads (safetensors)
    optimizer-llmK.pt       each agent's AdamW state (loaded with torch.load(weights_only=True))
    ema-llmK.safetensors    with Elastic Reset: each agent's adapter EMA
    rng.pt                  torch generators: sampling, minibatch order, global CPU (and CUDA)
    logs/                   metrics.jsonl and samples.jsonl up to this iteration: a resume
                            restores the logs from them, mending any line damaged since
    state.json              `TrainerState.record()` (iteration, data order, KL coefficients,
                            score statistics, skip counters, Python and NumPy RNG states) and a
                            SHA-256 of every file

It is built under a temporary name, every file fsynced, then renamed into place and the parent
directory fsynced (`atomic.atomic_directory`): a reader sees a whole checkpoint or none. The
last `train.keep_checkpoints` are kept. Loading verifies every checksum, so a damaged file is
reported, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cory_lora.algorithm.state import TrainerState
from cory_lora.engine.model import Agents
from cory_lora.errors import UserError, environment_error, os_error_message
from cory_lora.run.atomic import atomic_directory
from cory_lora.run.records import LOG_SNAPSHOT, snapshot_logs
from cory_lora.run.rundir import CHECKPOINTS, checkpoint_name
from cory_lora.services import distributed, faults


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
            f"`{distributed.cli('resume', run_dir)}`"
        )
    if (Path(run_dir) / "metrics.jsonl").exists():
        return (
            f"no checkpoint had been written yet, so there is nothing to resume; {run_dir} "
            "holds the log of the unfinished run: start again with --overwrite"
        )
    return "before training began; nothing was written"


def save_checkpoint(run_dir: Path, agents: Agents, state: TrainerState, keep: int) -> Path:
    """Write checkpoints/iter-NNNNNN/ atomically and drop the oldest beyond `keep`. A full disk
    (or another file-system failure) raises UserError; the older checkpoints stay intact.
    Under torchrun every rank calls it (it gathers every rank's random states); rank 0 writes,
    and the others wait for it."""
    rng = state.rng_tensors()
    if not distributed.is_main():
        distributed.barrier()
        return Path(run_dir) / CHECKPOINTS / checkpoint_name(state.iteration)
    try:
        path = _save_checkpoint(Path(run_dir), agents, state, keep, rng)
    except Exception as error:  # torch.save and safetensors wrap a full disk in their own types
        e = environment_error(error)
        if e is None:
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
            + f"; {kept}. Once that is fixed: {distributed.cli('resume', run_dir)}"
        ) from None
    distributed.barrier()
    return path


def _save_checkpoint(
    run_dir: Path, agents: Agents, state: TrainerState, keep: int, rng: dict
) -> Path:
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final = root / checkpoint_name(state.iteration)
    earlier = [p for p in list_checkpoints(run_dir) if completed(p) < state.iteration]
    # The same iteration saved again (e.g. after a resume) is replaced.
    with atomic_directory(final) as tmp:
        snapshot_logs(
            run_dir, state.iteration, tmp / LOG_SNAPSHOT, earlier[-1] if earlier else None
        )
        agents.save(tmp)
        for name, agent in state.agent_states.items():
            torch.save(agent.optimizer.state_dict(), tmp / f"optimizer-{name}.pt")
            if agent.ema is not None:
                save_file(agent.ema.state_dict(), str(tmp / f"ema-{name}.safetensors"))
        torch.save(rng, tmp / "rng.pt")
        faults.maybe_die("checkpoint")
        record = state.record()
        record["files"] = {
            str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / "state.json").write_text(json.dumps(record))
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, agents: Agents, state: TrainerState) -> bool:
    """Restore `agents` and `state` in place from checkpoint `path` (checksums verified first).
    False when it holds no sampling state for this rank (written by fewer processes)."""
    path = Path(path)
    try:
        record = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _corrupt(path, "state.json", "not UTF-8 text") from None
    except ValueError as e:
        raise _corrupt(path, "state.json", f"not valid JSON: {e}") from None
    except OSError as e:
        raise _corrupt(path, "state.json", e.strerror or str(e)) from None
    misfit = state.misfit(record)
    if misfit is not None:
        raise _corrupt(path, "state.json", misfit)
    for name, digest in record.get("files", {}).items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise _corrupt(path, name, "missing or its checksum does not match")
    try:
        agents.load(path, tuple(state.agent_states))
    except (RuntimeError, ValueError, KeyError) as e:  # e.g. config.toml edited to another shape
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {path} does not fit the run's recipe (was config.toml edited? model "
            f"and lora must stay as they were): {reason}"
        ) from None
    for name, agent in state.agent_states.items():
        optimizer_state = _load_plain(path / f"optimizer-{name}.pt")
        try:
            agent.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError) as e:
            raise _corrupt(path, f"optimizer-{name}.pt", f"does not fit this agent ({e})") from None
        if agent.ema is not None:
            ema = path / f"ema-{name}.safetensors"
            if not ema.is_file():
                raise _corrupt(path, ema.name, "missing (the run has reset.every set)")
            agent.ema.load_state_dict(load_file(str(ema)))
    own_sampling = state.load_rng_tensors(_load_plain(path / "rng.pt"))
    try:
        state.load_record(record)
    except (ValueError, TypeError, IndexError) as e:  # e.g. a random state of the wrong length
        raise _corrupt(path, "state.json", f"{type(e).__name__}: {e}") from None
    return own_sampling


def _load_plain(file: Path):
    """A torch.save file of plain data (tensors, numbers, strings, containers). Anything else is
    refused in our words: unpickling arbitrary objects can run code, and torch's own advice
    (weights_only=False) is the one thing not to do with a file from elsewhere."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise UserError(
            f"{file} holds objects other than plain data (tensors, numbers, strings), so it "
            "was not written by cory-lora as it is; it is not unpickled (that could run code). "
            "Delete its checkpoint directory to resume from the one before it"
        ) from None
    except (RuntimeError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else "unreadable"
        raise _corrupt(file.parent, file.name, reason) from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _corrupt(path: Path, name: str, reason: str) -> UserError:
    return UserError(
        f"checkpoint {path} is damaged ({name}: {reason}); delete that directory to resume from "
        "the one before it"
    )

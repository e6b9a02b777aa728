"""Checkpoints: everything a run's future depends on, written so that none is ever half-there.

A checkpoint is the directory `checkpoints/iter-NNNNNN/` (NNNNNN = iterations completed):

    llm1/, llm2/            PEFT adapters + value heads (safetensors)
    optimizer-llmK.pt       each agent's AdamW state (loaded with torch.load(weights_only=True))
    ema-llmK.safetensors    with Elastic Reset: each agent's adapter EMA
    rng.pt                  torch generators: sampling, minibatch order, global CPU (and CUDA)
    state.json              `TrainerState.record()` (iteration, data order, KL coefficients,
                            score statistics, skip counters, Python and NumPy RNG states) and a
                            SHA-256 of every file

It is built under a temporary name, every file fsynced, then renamed into place and the parent
directory fsynced (`outputs.atomic_directory`): a reader sees a whole checkpoint or none. The
last `train.keep_checkpoints` are kept. Loading verifies every checksum, so a damaged file is
reported, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cory_lora import faults
from cory_lora.errors import UserError
from cory_lora.model import Agents
from cory_lora.outputs import atomic_directory
from cory_lora.state import TrainerState

CHECKPOINTS = "checkpoints"


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (temporary directories start with '.'), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter-"))


def save_checkpoint(run_dir: Path, agents: Agents, state: TrainerState, keep: int) -> Path:
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final = root / checkpoint_name(state.iteration)
    # The same iteration saved again (e.g. after a resume) is replaced.
    with atomic_directory(final) as tmp:
        agents.save(tmp)
        for name, agent in state.agents.items():
            torch.save(agent.optimizer.state_dict(), tmp / f"optimizer-{name}.pt")
            if agent.ema is not None:
                save_file(agent.ema.state_dict(), str(tmp / f"ema-{name}.safetensors"))
        torch.save(state.rng_tensors(), tmp / "rng.pt")
        faults.maybe_die("checkpoint")
        record = state.record()
        record["files"] = {
            str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / "state.json").write_text(json.dumps(record))
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
    if not state.fits(record):
        raise _corrupt(path, "state.json", "written by another version or for other agents")
    agents.load(path, tuple(state.agents))
    for name, agent in state.agents.items():
        optimizer_state = torch.load(
            path / f"optimizer-{name}.pt", weights_only=True, map_location="cpu"
        )
        agent.optimizer.load_state_dict(optimizer_state)
        if agent.ema is not None:
            ema = path / f"ema-{name}.safetensors"
            if not ema.is_file():
                raise _corrupt(path, ema.name, "missing (the run has reset.every set)")
            agent.ema.load_state_dict(load_file(str(ema)))
    state.load_rng_tensors(torch.load(path / "rng.pt", weights_only=True))
    state.load_record(record)


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

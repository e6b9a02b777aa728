"""`--nproc-per-node K`: the same command in K processes, one per rank, started from this
process by torch.distributed's elastic launcher (what the `torchrun` script calls, without the
script). Plain `torchrun ... -m cory_lora run ...` keeps working: this is a convenience over it.

* Every check that can be made before a rank starts (the recipe, the batch split over the ranks,
  the GPUs there are) is made once, here: one line, exit 2, no rank started.
* Rank 0 prints to this terminal; the other ranks' output goes to log files in a temporary
  directory, which is removed when every rank succeeded and named when one failed.
* A rank that fails gives one line naming it, its exit code and its log; never the launcher's
  traceback. Ctrl-C, SIGTERM and SIGHUP reach every rank once (the launcher passes them on):
  each finishes its iteration and the run checkpoints.
* Multi-node: `--nnodes N --node-rank R --rdzv-endpoint HOST:PORT` on every node (a static
  rendezvous, as torchrun's default). One node needs none of them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from cory_lora.errors import PEER_LOST_EXIT, UserError
from cory_lora.run.interrupts import PARENT_PID, STOP_EXIT_CODES, Terminated, stopped_by_signal
from cory_lora.services.distributed import check_batch_split

NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc-per-node",
        min=1,
        metavar="K",
        help="Processes (ranks) on this machine: data parallel, one GPU each (torchrun's "
        "--nproc-per-node).",
    ),
]
NnodesOpt = Annotated[
    int, typer.Option("--nnodes", min=1, metavar="N", help="Machines taking part (multi-node).")
]
NodeRankOpt = Annotated[
    int, typer.Option("--node-rank", min=0, metavar="R", help="This machine's rank among --nnodes.")
]
EndpointOpt = Annotated[
    str,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Node 0's address, where the nodes meet (multi-node).",
    ),
]
SHUTDOWN_TIMEOUT_S = 3600  # the ranks' time to finish an iteration and checkpoint when stopped


@dataclass(frozen=True)
class Launch:
    """How many processes run a command, and where they meet."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""

    @property
    def wanted(self) -> bool:
        """Whether this command starts ranks instead of running itself."""
        return self.nproc_per_node * self.nnodes > 1 and "RANK" not in os.environ

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def check(self, batch_size: int, device: str) -> None:
        """What can be checked before any rank starts; UserError (exit 2) otherwise."""
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigLikeError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if self.node_rank >= self.nnodes:
            text = f"--node-rank {self.node_rank}: must be below --nnodes {self.nnodes}"
            raise ConfigLikeError(text)
        try:
            check_batch_split(batch_size, self.world_size)
        except UserError as e:
            raise ConfigLikeError(str(e)) from None
        _check_devices(device, self.nproc_per_node)


class ConfigLikeError(UserError):
    """A recipe that cannot run on this many ranks (exit 2, as a recipe problem)."""

    exit_code = 2


def _check_devices(device: str, nproc: int) -> None:
    import torch

    wants_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not wants_gpu:
        return  # CPU ranks (gloo): any number, each with its share of the cores
    if device.startswith("cuda:"):
        raise ConfigLikeError(
            f"model.device = {device!r} with --nproc-per-node {nproc}: each rank takes its own "
            "GPU; use model.device = 'cuda' (or 'auto')"
        )
    found = torch.cuda.device_count()
    if nproc > found:
        raise ConfigLikeError(
            f"--nproc-per-node {nproc}: this machine has {found} CUDA device(s) "
            "(CUDA_VISIBLE_DEVICES limits them); one rank per GPU"
        )


def launch(spec: Launch, args: list[str]) -> None:
    """Run `cory-lora ARGS` in spec.nproc_per_node ranks here; typer.Exit with the outcome."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we say it
    logs = Path(tempfile.mkdtemp(prefix="cory-lora-ranks-"))
    quiet_ranks = {rank: Std.ALL for rank in range(spec.nproc_per_node) if rank or spec.node_rank}
    static = spec.nnodes > 1
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=str(uuid.uuid4()) if not static else "cory-lora",
        rdzv_backend="static" if static else "c10d",
        rdzv_endpoint=spec.rdzv_endpoint if static else "localhost:0",
        rdzv_configs={"rank": spec.node_rank} if static else {},
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=quiet_ranks),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    _share_cores(spec.nproc_per_node)
    os.environ[PARENT_PID] = str(os.getpid())  # each rank dies with this process
    try:
        elastic_launch(config, sys.executable)("-m", "cory_lora", *args)
    except ChildFailedError as e:
        code, logs_named = _failed(e, logs)
        if not logs_named:
            shutil.rmtree(logs, ignore_errors=True)
        raise typer.Exit(code) from None
    except SignalException as e:
        shutil.rmtree(logs, ignore_errors=True)
        raise Terminated(e.sigval) from None  # the ranks got it too, and checkpointed
    shutil.rmtree(logs, ignore_errors=True)


def _share_cores(nproc: int) -> None:
    """Each rank's torch threads: this machine's cores shared out (torchrun sets 1), unless the
    user chose OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


HANDLED = (1, 2, *STOP_EXIT_CODES)  # exit codes after which a rank has said why itself


def _followed(code: int) -> bool:
    """How a rank ends when it only followed another's end: stopped by a signal (the launcher
    stops every rank once one fails), or its collectives lost the rank that failed."""
    return stopped_by_signal(code) or code == PEER_LOST_EXIT


def _failed(error, logs: Path) -> tuple[int, bool]:
    """The command's exit code when ranks failed: the first failing rank's, preferring one that
    failed on its own over one the launcher then stopped. One line names it and its log, unless
    it is rank 0 and said why on this terminal already. Returns (exit code, logs named)."""
    rank, failure = min(error.failures.items(), key=lambda f: (_followed(f[1].exitcode), f[0]))
    code = failure.exitcode
    if code < 0:  # killed by a signal it did not handle
        what, code = f"was killed by {signal.Signals(-code).name}", 128 - code
    else:
        what = "stopped" if _followed(code) else f"failed (exit code {code})"
    if rank == 0 and code in HANDLED:
        return code, False
    found = sorted(p for p in logs.rglob(str(failure.local_rank)) if p.is_dir())
    where = f"; its output: {found[0]}/" if found else ""
    typer.echo(f"rank {rank} {what}{where}", err=True)
    return code, bool(found)

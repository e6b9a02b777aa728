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
  rendezvous, as torchrun's default). One node needs none of them. Before torch's launcher
  starts, the nodes meet in plain Python on that port (`meet`): each node says in one line what
  it waits for, where and for how long; Ctrl-C and SIGTERM stop the wait at once (torch's own
  wait is in C++, deaf to both); a port already in use on node 0 is one line; no node arriving
  in time is one line naming the nodes missing. Then torch's rendezvous finds every node there.
* A rank that fails says why in its log (its message, not only rank 0's), and the launcher
  shows that message with the rank's number.
* Every rank knows the launch flags (CORY_LORA_LAUNCH_FLAGS), so a resume hint names them all.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from cory_lora.errors import PEER_LOST_EXIT, UserError
from cory_lora.run.interrupts import PARENT_PID, STOP_EXIT_CODES, Terminated, stopped_by_signal
from cory_lora.services.distributed import LAUNCH_FLAGS, check_batch_split

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
MEET_TIMEOUT_S = 900  # how long the nodes wait for each other (torch's rendezvous default)
RANK_LOGS = "CORY_LORA_RANK_LOGS"  # set for the ranks: their output goes to a log file we read


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

    @property
    def flags(self) -> list[str]:
        """The launch flags as given on the command line (for a resume hint)."""
        flags = ["--nproc-per-node", str(self.nproc_per_node)]
        if self.nnodes > 1:
            flags += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
            flags += ["--rdzv-endpoint", self.rdzv_endpoint]
        return flags

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigLikeError(
                f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT (node 0's address "
                "and a free port on it, e.g. node0.cluster:29500)"
            )
        return host.strip("[]"), int(port)

    def check(self, batch_size: int, device: str) -> None:
        """What can be checked before any rank starts; UserError (exit 2) otherwise."""
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigLikeError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if self.node_rank >= self.nnodes:
            text = f"--node-rank {self.node_rank}: must be below --nnodes {self.nnodes}"
            raise ConfigLikeError(text)
        if self.nnodes > 1:
            self.host_port()
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
    os.environ[LAUNCH_FLAGS] = shlex.join(spec.flags)  # for the ranks' resume hints
    os.environ[RANK_LOGS] = "1"
    try:
        if static:
            meet(spec)
        elastic_launch(config, sys.executable)("-m", "cory_lora", *args)
    except ChildFailedError as e:
        code, logs_named = _failed(e, logs)
        if not logs_named:
            shutil.rmtree(logs, ignore_errors=True)
        raise typer.Exit(code) from None
    except SignalException as e:
        shutil.rmtree(logs, ignore_errors=True)
        raise Terminated(e.sigval) from None  # the ranks got it too, and checkpointed
    except BaseException:  # the nodes did not meet (stopped, timed out, port in use)
        shutil.rmtree(logs, ignore_errors=True)
        raise
    finally:
        for name in (LAUNCH_FLAGS, RANK_LOGS):
            os.environ.pop(name, None)
    shutil.rmtree(logs, ignore_errors=True)


HELLO, GO = b"cory-lora node ", b"go\n"


def meet(spec: Launch, timeout_s: float = MEET_TIMEOUT_S) -> None:
    """Wait until every node has started the command: node 0 listens on the rendezvous port,
    the others connect to it; when all are there, node 0 says go and closes the port for
    torch's rendezvous store. Python sockets with short timeouts, so Ctrl-C and SIGTERM stop
    the wait at once. UserError for a port in use, or a node that does not come in time."""
    host, port = spec.host_port()
    if spec.node_rank == 0:
        _meet_as_node_0(spec, port, timeout_s)
    else:
        _meet_as_node(spec, host, port, timeout_s)


def _say(text: str) -> None:
    typer.echo(text, err=True)


def _meet_as_node_0(spec: Launch, port: int, timeout_s: float) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", port))
    except OSError as e:
        listener.close()
        why = (
            "is in use (another run, or another service?)"
            if e.errno == errno.EADDRINUSE
            else (f"cannot be opened ({e.strerror})")
        )
        raise UserError(
            f"--rdzv-endpoint {spec.rdzv_endpoint}: port {port} on this machine (node 0) {why}; "
            "choose another port, the same on every node"
        ) from None
    missing = set(range(1, spec.nnodes))
    _say(
        f"node 0 of {spec.nnodes}: waiting at {spec.rdzv_endpoint} for node(s) "
        f"{_listed(missing)} (up to {timeout_s:.0f} s; Ctrl-C stops)"
    )
    arrived: list[socket.socket] = []
    deadline = time.monotonic() + timeout_s
    with listener:
        listener.listen(spec.nnodes)
        listener.settimeout(0.5)
        while missing:
            if time.monotonic() > deadline:
                for peer in arrived:
                    peer.close()
                raise UserError(
                    f"node(s) {_listed(missing)} did not come to {spec.rdzv_endpoint} within "
                    f"{timeout_s:.0f} s; start the same command on every node, each with its "
                    "--node-rank"
                )
            try:
                peer, _ = listener.accept()
            except TimeoutError:
                continue
            rank = _hello(peer)
            if rank in missing:
                missing.discard(rank)
                arrived.append(peer)
            else:
                peer.close()  # not one of ours, or a node twice
        for peer in arrived:
            with peer:
                peer.sendall(GO)
    _say(f"all {spec.nnodes} nodes are here: starting")


def _hello(peer: socket.socket) -> int | None:
    peer.settimeout(5)
    try:
        line = peer.recv(64)
    except OSError:
        return None
    if not line.startswith(HELLO) or not line[len(HELLO) :].strip().isdigit():
        return None
    return int(line[len(HELLO) :].strip())


def _meet_as_node(spec: Launch, host: str, port: int, timeout_s: float) -> None:
    _say(
        f"node {spec.node_rank} of {spec.nnodes}: waiting for node 0 at {spec.rdzv_endpoint} "
        f"(up to {timeout_s:.0f} s; Ctrl-C stops)"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2) as peer:
                peer.sendall(HELLO + f"{spec.node_rank}\n".encode())
                peer.settimeout(max(1.0, deadline - time.monotonic()))
                if _wait_for_go(peer):
                    _say(f"all {spec.nnodes} nodes are here: starting")
                    return
        except OSError:  # node 0 not there yet (refused, unreachable, name not resolved yet)
            pass
        time.sleep(0.5)
    raise UserError(
        f"node 0 did not answer at {spec.rdzv_endpoint} within {timeout_s:.0f} s; start the same "
        "command on node 0 (--node-rank 0), and check that this machine reaches that address"
    )


def _wait_for_go(peer: socket.socket) -> bool:
    """Read node 0's go, in short steps so that a signal is handled between them."""
    deadline = time.monotonic() + (peer.gettimeout() or 1.0)
    peer.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            data = peer.recv(8)
        except TimeoutError:
            continue
        return data == GO
    return False


def _listed(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


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
    said = _its_message(found[0]) if found else None
    typer.echo(f"rank {rank} {what}{f': {said}' if said else ''}{where}", err=True)
    return code, bool(found)


def _its_message(directory: Path) -> str | None:
    """The rank's own one-line error (`error: ...`, `internal error: ...`) from its log."""
    for name in ("stderr.log", "stdout.log"):
        try:
            lines = (directory / name).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            text = line.strip()
            if text.startswith(("error:", "internal error:", "stopped")):
                return text.removeprefix("error:").strip()
    return None

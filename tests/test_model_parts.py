"""Larger real models from their PyPI parts (exactspec/model_parts.py): a short name assembles the parts once into the
cache and checks the sha256; a missing or wrong part is one line and writes nothing; and (slow) greedy speculation
on the real Qwen2.5-Coder-0.5B Q4_K_M, read by the fused runtime from the file alone, keeps plain decoding's tokens."""

from __future__ import annotations

import hashlib
import importlib
import re
import shutil

import pytest

from exactspec import model_parts
from exactspec.errors import UsageError
from exactspec.model_parts import PartedModel, assembled_path
from exactspec.models import model_path

PARTS = [bytes(range(256)) * 40, b"middle part" * 1000, b"the end"]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A model of three installed parts (packages fakepart1..3 on sys.path), and an empty cache."""
    site = tmp_path / "site"
    for number, data in enumerate(PARTS, start=1):
        package = site / f"fakepart{number}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{number:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))
    whole = b"".join(PARTS)
    model = PartedModel("fake.gguf", "fake-extra", "fakepart", 3, len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(model_parts.PARTED_MODELS, "fake-model", model)
    return site, tmp_path / "cache" / "models"


def test_a_short_name_assembles_the_parts_once_and_checks_them(fake, capsys):
    _, models = fake
    path = model_path("fake-model")
    assert path == models / "fake.gguf" and path.read_bytes() == b"".join(PARTS)
    assert "assembling fake.gguf from its 3 parts" in capsys.readouterr().err
    assert model_path("fake-model") == path and capsys.readouterr().err == ""  # kept: not assembled again
    assert list(models.iterdir()) == [path]


def test_a_missing_or_wrong_part_is_one_line_and_writes_nothing(fake):
    site, models = fake
    (site / "fakepart2" / "data" / "part02.bin").unlink()
    with pytest.raises(UsageError, match=r"part 2 of 3 \(fakepart2\) lacks data/part02.bin") as error:
        assembled_path("fake-model")
    assert "\n" not in str(error.value) and "exactspec[fake-extra]" in str(error.value)
    (site / "fakepart2" / "data" / "part02.bin").write_bytes(PARTS[1][:-1] + b"X")  # one byte off
    with pytest.raises(UsageError, match="do not make its file"):
        assembled_path("fake-model")
    (site / "fakepart2" / "data" / "part02.bin").write_bytes(PARTS[1])
    shutil.rmtree(site / "fakepart3")
    importlib.invalidate_caches()
    with pytest.raises(UsageError, match=r"part 3 of 3 \(fakepart3\) is not installed: pip install"):
        assembled_path("fake-model")
    assert not models.exists() or list(models.iterdir()) == []


@pytest.mark.slow
def test_speculation_on_the_real_0_5b_keeps_plain_decodings_tokens():
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K matrices, qwen2's biases), on the fused runtime
    from the file alone: greedy prompt lookup and retrieval at k = 4 and auto give plain decoding's 48 tokens."""
    from exactspec.api import SpecDecoder

    try:
        path = str(model_path("qwen2.5-coder-0.5b"))
    except UsageError as error:
        pytest.skip(str(error))
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    found = set()
    for drafter in ("none", "prompt-lookup", "retrieval"):
        decoder = SpecDecoder.load(path, drafter=drafter, backend="fused", threads=2)
        assert decoder.target.backend_name == "fused" and decoder.target.model is None
        for k in ((4,) if drafter == "none" else (4, "auto")):
            found.add(tuple(decoder.generate(prompt, max_new_tokens=48, num_draft_tokens=k, chat=False).token_ids))
    assert len(found) == 1


def test_each_models_extra_lists_its_parts_and_the_lock_pins_them():
    """pyproject.toml's extra of each parted model installs exactly its parts, under its normalised name (pip
    before 23.3 does not normalise a requested qwen-coder-1.5b to the metadata's qwen-coder-1-5b, and installs no
    part), and constraints.txt pins every one."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    locked = (root / "constraints.txt").read_text()
    for model in model_parts.PARTED_MODELS.values():
        names = [model.part_name(n).replace("_", "-") for n in range(1, model.parts + 1)]
        assert extras[model.extra] == names and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", model.extra)
        assert all(f"\n{name}==" in locked for name in names)

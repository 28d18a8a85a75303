"""``python -m exactspec.bench.passes`` on a tiny GGUF: the pass costs beside the floor, the integer peak and the path
that ran it, and the prompt rates with the fused runtime's share of that peak."""

from __future__ import annotations

import re

import pytest
from tiny_gguf import write_tiny_gguf

from exactspec.backends import native

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


def test_the_passes_bench_prints_costs_the_floor_the_peak_and_its_share(tmp_path, capsys):
    from exactspec.bench import passes

    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=1, tensor_type="Q4_0", layers=2, hidden=64, heads=4,
                           kv_heads=2, ffn=128, context=512)
    assert passes.main(["--model", str(path), "--threads", "1", "--context", "8", "--repeats", "1",
                        "--prompts", "16,64", "--prompt-repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"llama.cpp (GGUF as stored)", "fused (as stored, integer products)"} <= set(rows)
    assert any(name.startswith("floor: max(weights / bandwidth") for name in rows)
    peak = re.search(r"integer peak (\d+) G multiply-adds/s \((.+), 1 threads at once\)", out)
    assert peak and int(peak[1]) > 0 and ("maddubs" in peak[2] or "vpdpbusd" in peak[2])
    assert f"many rows' products: {native.tiles()}" in out
    # prompt rates at 16 and 64 tokens; the two fused runtimes' with their share of the integer peak
    shares = re.findall(r"(\d+)/s \([\d.]+x, (\d+)% of the peak\)", out)
    assert len(shares) == 4 and all(int(rate) > 0 and int(share) > 0 for rate, share in shares)

"""``python -m exactspec.bench.passes`` on a tiny GGUF: the pass costs beside the floor, the integer peak and the path
that ran it, and the prompt rates with the fused runtime's share of that peak."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


@pytest.mark.parametrize("script, arguments", [
    ("exactspec.bench.numerics", ["--model", "missing.gguf"]),
    ("exactspec.bench.passes", ["--model", "missing.gguf", "--prompts", ""]),
    ("exactspec.bench.numerics", ["--model", "tiny.gguf", "--prompts", "missing.jsonl"]),
])
def test_a_bench_scripts_bad_input_is_one_line_and_exit_2(tmp_path, script, arguments):
    """Bad input to a ``python -m`` bench script (a model or prompt file that is not there) ends it as the CLI ends
    a command: one line naming the script and the fault, exit 2, no traceback."""
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1, tensor_type="Q4_0", layers=1, hidden=64, heads=4, kv_heads=2,
                    ffn=128, context=512)
    run = subprocess.run([sys.executable, "-m", script, *arguments], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, check=False, env={**os.environ, "EXACTSPEC_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.splitlines()[-1]  # after any progress lines (packing the model it read)
    assert last.startswith(f"{script}: error: ") and "missing" in last, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]

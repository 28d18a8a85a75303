"""Every runtime against what the house asks of a runtime (tests/runtime_checks.py): its declarations, its cache
and rollback, and its pool where it declares one; bit for bit where its rows do not depend on the pass."""

from __future__ import annotations

import pytest
from runtime_checks import check_runtime
from tiny import require_pass_invariant, tiny_llama
from tiny_gguf import write_tiny_gguf

from exactspec.backends import FusedRuntime, HFCausalLM, LeanRuntime
from exactspec.backends.base import rows_are_pass_invariant
from exactspec.backends.fused import unavailable


@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16"])
def test_the_lean_runtime(precision):
    runtime = require_pass_invariant(LeanRuntime(tiny_llama(seed=0, init_range=0.5), precision))
    check_runtime(runtime)
    assert runtime.name == "lean"


@pytest.mark.parametrize("weights", ["float16", "int8"])
def test_the_fused_runtime(weights):
    model = tiny_llama(seed=0, init_range=0.5)
    if unavailable(model, weights) is not None:
        pytest.skip(unavailable(model, weights))
    runtime = FusedRuntime(model, weights)
    check_runtime(runtime)
    assert runtime.name == "fused" and rows_are_pass_invariant(runtime)


def test_the_transformers_runtime():
    """No pool; its rows may depend on the pass (PyTorch's kernels), so pieces agree within float32 rounding."""
    runtime = HFCausalLM(tiny_llama(seed=0, init_range=0.5))
    check_runtime(runtime, tolerance=1e-4)
    assert runtime.name == "transformers"


def test_the_llama_cpp_runtime(tmp_path):
    pytest.importorskip("llama_cpp")
    from exactspec.backends.llamacpp import LlamaCppLM

    runtime = LlamaCppLM.load(write_tiny_gguf(tmp_path / "tiny.gguf", context=512, seed=0, tensor_type="Q8_0"),
                              threads=2)
    check_runtime(runtime, tolerance=1e-3)
    assert runtime.name == "llama.cpp"


def test_the_fused_runtime_read_from_a_gguf(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", context=512, seed=0, tensor_type="Q4_1")
    if unavailable() is not None:
        pytest.skip(unavailable())
    runtime = FusedRuntime.from_gguf(path)
    check_runtime(runtime)
    assert runtime.name == "fused" and rows_are_pass_invariant(runtime)

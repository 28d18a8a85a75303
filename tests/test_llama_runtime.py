"""The lean llama runtime computes what transformers' module computes, through extend and rollback."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama
from transformers import MistralConfig, MistralForCausalLM

from specdec.backends import HFCausalLM, LlamaRuntime, make_backend
from specdec.backends import llama as llama_backend


def reference_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def runtime_logits_in_pieces(runtime: LlamaRuntime, ids: list[int], pieces: list[int]) -> torch.Tensor:
    """Feed ids in pieces of the given sizes, with a detour (extend, then roll back) between pieces."""
    out, done = [], 0
    for size in pieces:
        out.append(runtime.extend(ids[done : done + size], size).float())
        done += size
        runtime.extend([7, 7, 7], 3)
        runtime.rollback(done)
    return torch.cat(out)


# float64 agrees up to summation order; float32 and bfloat16 within a few units of their rounding (2**-24 and
# 2**-8 relative) of the largest logit. bfloat16 uses a small-weight model: with large random weights a network
# amplifies any rounding difference, transformers' own cached path included.
@pytest.mark.parametrize("dtype, init_range, units", [
    (torch.float64, 0.5, 1e-12), (torch.float32, 0.5, 64 * 2**-24), (torch.bfloat16, 0.02, 4 * 2**-8),
])
def test_logits_match_transformers(dtype, init_range, units):
    model = tiny_llama(seed=4, init_range=init_range).to(dtype)
    ids = [int(i) for i in torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(0))]
    ours = runtime_logits_in_pieces(LlamaRuntime(model), ids, [17, 1, 5, 1, 16])
    reference = reference_logits(model, ids)
    assert (ours - reference).abs().max() <= units * reference.abs().max()


def test_cache_grows_past_its_first_allocation():
    model = tiny_llama(seed=4, init_range=0.5).double()
    ids = [int(i) for i in torch.randint(3, 64, (llama_backend.INITIAL_CAPACITY + 60,),
                                         generator=torch.Generator().manual_seed(1))]
    runtime = LlamaRuntime(model)
    ours = runtime_logits_in_pieces(runtime, ids, [200, 50, 1, 65])
    assert (ours - reference_logits(model, ids)).abs().max() < 1e-12
    assert runtime.tokens == ids


def test_make_backend_picks_the_runtime_only_where_it_is_exact():
    assert isinstance(make_backend(tiny_llama(seed=0)), LlamaRuntime)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert isinstance(make_backend(mistral), HFCausalLM)
    scaled = tiny_llama(seed=0)
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert isinstance(make_backend(scaled), HFCausalLM)

"""The lean runtime computes what transformers' module computes, through extend and rollback, for each family it
supports and each weight precision."""

from __future__ import annotations

import pytest
import torch
from tiny import float32_error, require_pass_invariant, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from exactspec.backends import HFCausalLM, LeanRuntime, family, make_backend, sequence
from exactspec.backends.linear import BULK_POSITIONS, DTYPE_OF, PassPrecisions

FAMILY_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5,
                    tie_word_embeddings=False)


def tiny_family(name: str, seed: int = 4):
    torch.manual_seed(seed)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**FAMILY_SHAPE)).eval()
    if name == "llama-with-biases":
        return LlamaForCausalLM(LlamaConfig(**FAMILY_SHAPE, attention_bias=True, mlp_bias=True)).eval()
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**FAMILY_SHAPE, sliding_window=None)).eval()
    model = Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE)).eval()  # biases on q, k and v
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0.0, 0.5)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_logits_exactly(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] float64
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def runtime_logits_in_pieces(runtime: LeanRuntime, ids: list[int], pieces: list[int]) -> torch.Tensor:
    """Feed ids in pieces of the given sizes, with a detour (extend, then roll back) between pieces."""
    out, done = [], 0
    for size in pieces:
        out.append(runtime.extend(ids[done : done + size], size).float())
        done += size
        runtime.extend([7, 7, 7], 3)
        runtime.rollback(done)
    return torch.cat(out)


def random_ids(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed))]


def rounded_copy(model, precision: str):
    """The model in float32 with its matmul weights rounded to ``precision`` (embeddings and norms stay): what a
    runtime holding its weights in that precision computes, up to float32 rounding of the activations."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict({
        name: tensor.to(DTYPE_OF[precision]).float() if _is_matmul_weight(name) else tensor
        for name, tensor in model.state_dict().items()
    })
    return copy


def _is_matmul_weight(name: str) -> bool:
    return name.endswith("proj.weight") or name == "lm_head.weight"


@pytest.mark.parametrize("family", ["llama", "llama-with-biases", "mistral", "qwen2"])
def test_each_family_matches_transformers_in_float64(family):
    """float64 agrees up to summation order: the runtime computes the same function as transformers' module."""
    model = tiny_family(family).double()
    assert isinstance(make_backend(model), LeanRuntime)
    ids = random_ids(40)
    ours = runtime_logits_in_pieces(LeanRuntime(model), ids, [17, 1, 5, 1, 16])
    assert (ours - reference_logits(model, ids)).abs().max() < 1e-12


# The runtime's activations are float32 whatever holds the weights (its row kernels convert each weight to float32
# exactly). So against the exact function of the same rounded weights (float64), its logits may be as wrong as a
# float32 evaluation of that function is, and no more. The bound is derived on the machine at hand, not fitted to
# one: transformers' own float32 forward pass over the same weights and positions, whose error against float64 grows
# with the model's sizes and the float32 rounding unit. Two float32 evaluations that differ only in summation order
# have errors of the same spread, so the largest of one is allowed twice the largest of the other (measured on a Zen
# 4 EPYC: 1.06x, 0.79x and 0.80x of the reference's), with one unit of float32 rounding (2**-24) of the largest
# logit as a floor where the reference happens to be nearly exact.
@pytest.mark.parametrize("precision, init_range", [("float32", 0.5), ("float16", 0.5), ("bfloat16", 0.02)])
def test_logits_match_transformers_for_each_weight_precision(precision, init_range):
    model = tiny_llama(seed=4, init_range=init_range)
    runtime = LeanRuntime(model, precision)
    if not runtime.pass_invariant:
        pytest.skip("the row kernels do not run here: the libraries' bfloat16 product rounds activations too")
    ids = random_ids(40)
    ours = runtime_logits_in_pieces(runtime, ids, [17, 1, 5, 1, 16]).double()
    rounded = rounded_copy(model, precision)
    reference = reference_logits(rounded, ids).double()  # float32
    exact = reference_logits_exactly(rounded.double(), ids)  # the same weights, float64 (.double() is in place)
    reference_error = (reference - exact).abs().max()
    floor = 2**-24 * exact.abs().max()
    assert (ours - exact).abs().max() <= 2 * reference_error + floor


def test_the_runtime_declares_its_rows_alone_only_on_the_row_kernels(monkeypatch):
    """On the row kernels (the CPU, built) every product and the attention are the C kernels'; float64, or a machine
    where they are not built, computes with the libraries' kernels, and the runtime says its rows may depend on
    the pass."""
    from exactspec.backends import native

    model = tiny_llama(seed=0)
    assert LeanRuntime(model, "float16").pass_invariant and LeanRuntime(model, "bfloat16").pass_invariant
    assert not LeanRuntime(model.double()).pass_invariant
    monkeypatch.setattr(native, "unavailable", lambda: "its C extension was not built at install")
    assert not LeanRuntime(tiny_llama(seed=0), "float32").pass_invariant


def test_each_kind_of_pass_runs_in_its_own_precision():
    model = tiny_llama(seed=4, init_range=0.5)
    runtime = LeanRuntime(model, PassPrecisions(decode="float16", score="float32"))
    ids = random_ids(12)
    several = runtime.extend(ids[:11], 11)  # [11, vocab] a scoring pass
    one = runtime.extend(ids[11:], 1)  # [1, vocab] a decode pass
    reference32, reference16 = reference_logits(model, ids), reference_logits(rounded_copy(model, "float16"), ids)
    tolerance = 3 * float32_error(model, ids)  # exactspec's float32 against transformers' (tiny.float32_error)
    assert (several - reference32[:11]).abs().max() <= tolerance
    # a float16-weight step over a cache of float32-weight keys: near float16's reference, not within float32's
    # rounding of it (its cache is another model's); 1e-2 of the largest logit is 20 units of float16's rounding
    assert (one[0] - reference16[11]).abs().max() <= 1e-2 * reference16.abs().max()
    assert (one[0] - reference32[11]).abs().max() > tolerance  # ... and not a float32 one
    assert (one[0] - reference_logits(model, ids)[11]).abs().max() > 0


def test_a_bulk_pass_runs_in_its_own_precision():
    model = tiny_llama(seed=4, init_range=0.5)
    runtime = LeanRuntime(model, PassPrecisions(decode="float32", score="float32", bulk="float16"))
    ids = random_ids(BULK_POSITIONS + 1)
    bulk = runtime.extend(ids, len(ids))  # [33, vocab] prefill-sized: a bulk pass
    rounded16 = rounded_copy(model, "float16")
    reference32, reference16 = reference_logits(model, ids), reference_logits(rounded16, ids)
    assert (bulk - reference16).abs().max() <= 3 * float32_error(rounded16, ids)
    assert (bulk - reference32).abs().max() > 3 * float32_error(model, ids)


def test_cache_grows_past_its_first_allocation_and_keeps_a_reservation():
    model = tiny_llama(seed=4, init_range=0.5).double()
    ids = random_ids(sequence.INITIAL_CAPACITY + 60, seed=1)
    runtime = LeanRuntime(model)
    ours = runtime_logits_in_pieces(runtime, ids, [200, 50, 1, 65])
    assert (ours - reference_logits(model, ids)).abs().max() < 1e-12
    assert runtime.tokens == ids
    reserved = LeanRuntime(model)
    reserved.reserve(len(ids) + 4)
    blocks = family.whole_blocks(len(ids) + 4)  # sized to the request, in whole blocks of keys
    assert reserved._capacity == blocks
    assert (runtime_logits_in_pieces(reserved, ids, [200, 50, 1, 65]) - ours).abs().max() < 1e-12
    assert reserved._capacity == blocks  # no pass reallocated it


def test_make_backend_picks_the_runtime_only_where_it_is_exact():
    assert isinstance(make_backend(tiny_llama(seed=0)), LeanRuntime)
    scaled = tiny_llama(seed=0)
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert isinstance(make_backend(scaled), HFCausalLM)
    sliding = Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE, use_sliding_window=True, sliding_window=8))
    assert isinstance(make_backend(sliding), HFCausalLM)


def test_a_sliding_window_caps_the_length():
    mistral = MistralForCausalLM(MistralConfig(**FAMILY_SHAPE, sliding_window=100))
    assert LeanRuntime(mistral).max_length == 100


def test_a_tree_pass_scores_every_branch_as_its_own_chain_and_keeps_the_accepted_one():
    """extend_tree: the logits after each node are those of the chain root..node after the cache; keep_path leaves
    the cache (tokens, keys, values, hidden states) as if the accepted branch had been fed as a chain."""
    model = tiny_family("llama").double()
    runtime = LeanRuntime(model)
    runtime.keep_hidden_states()
    prefix = random_ids(9, seed=1)
    runtime.extend(prefix, 0)
    #  root 10 -> 11 -> 12
    #          -> 13 -> 14
    #                -> 15
    tokens, parents = [10, 11, 12, 13, 14, 15], [-1, 0, 1, 0, 3, 3]
    logits = runtime.extend_tree(tokens, parents)
    for node in range(len(tokens)):
        branch, up = [], node
        while up >= 0:
            branch.insert(0, tokens[up])
            up = parents[up]
        expected = reference_logits(model, prefix + branch)[-1]
        torch.testing.assert_close(logits[node].float(), expected, rtol=0, atol=1e-5)
    runtime.keep_path(len(prefix), [0, 3, 5])
    assert runtime.tokens == prefix + [10, 13, 15]
    chain = LeanRuntime(model)
    chain.keep_hidden_states()
    chain.extend(prefix + [10, 13, 15], 0)
    torch.testing.assert_close(runtime.hidden_states, chain.hidden_states, rtol=0, atol=1e-9)
    after = runtime.extend([16, 17], 2)
    torch.testing.assert_close(after.float(), reference_logits(model, prefix + [10, 13, 15, 16, 17])[-2:], rtol=0,
                               atol=1e-5)
    # a branch already in place (the first child's): only the rest is dropped
    start = len(runtime.tokens)
    runtime.extend_tree([18, 19, 20], [-1, 0, 0])
    runtime.keep_path(start, [0, 1])
    assert runtime.tokens == prefix + [10, 13, 15, 16, 17, 18, 19]
    torch.testing.assert_close(runtime.extend([21], 1)[0].float(),
                               reference_logits(model, prefix + [10, 13, 15, 16, 17, 18, 19, 21])[-1], rtol=0,
                               atol=1e-5)


def test_a_tree_whose_parent_comes_after_its_child_is_refused():
    runtime = LeanRuntime(tiny_family("llama"))
    runtime.extend(random_ids(4), 0)
    with pytest.raises(ValueError, match="does not come before"):
        runtime.extend_tree([5, 6, 7], [-1, 2, 0])


def test_a_pass_after_shallow_runs_reuses_them_and_computes_the_same_logits(monkeypatch):
    """Self-speculation's shared cache: tokens run through the first L layers by extend_shallow (one at a time, as
    drafting does) are run only through the layers after L by the next extend over them; the logits equal those
    of a plain pass (float64: to rounding), and so does every later pass (the shared layers' cache holds them)."""
    model = tiny_llama(seed=5, layers=4, init_range=0.5).double()
    prompt, draft = random_ids(9, seed=1), random_ids(4, seed=2)
    plain = LeanRuntime(model)
    plain.extend(prompt, 0)
    expected = plain.extend(draft, len(draft))
    after = plain.extend([9, 10], 2)

    runtime = LeanRuntime(model)
    runtime.extend(prompt, 0)
    states = [runtime.extend_shallow([token], 2) for token in draft[:3]]  # [1, hidden] each
    assert all(s.shape == (1, 32) for s in states) and len(runtime.tokens) == len(prompt)  # not yet in the cache
    ran = []
    layers = LeanRuntime.run_layers
    monkeypatch.setattr(LeanRuntime, "run_layers", lambda self, x, first, end, *rest: ran.append(
        (first, end, x.shape[0])) or layers(self, x, first, end, *rest))
    logits = runtime.extend(draft, len(draft))
    assert ran == [(0, 2, 1), (2, 4, 4)]  # the last draft token through the shared layers, then all four deeper
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(runtime.extend([9, 10], 2), after, rtol=0, atol=1e-10)


def test_shallow_runs_are_dropped_by_a_rollback_or_other_tokens():
    model = tiny_llama(seed=5, layers=4, init_range=0.5).double()
    prompt = random_ids(6, seed=3)
    plain = LeanRuntime(model)
    expected = plain.extend(prompt + [11, 12], 2)
    runtime = LeanRuntime(model)
    runtime.extend(prompt, 0)
    runtime.extend_shallow([40, 41], 3)  # other tokens than the pass will bring
    torch.testing.assert_close(runtime.extend([11, 12], 2), expected, rtol=0, atol=1e-10)
    runtime.rollback(len(prompt))
    runtime.extend_shallow([11], 3)
    runtime.rollback(len(prompt))  # the round was abandoned
    torch.testing.assert_close(runtime.extend([11, 12], 2), expected, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="layers must be in 1..4"):
        runtime.extend_shallow([3], 5)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_a_tree_node_computes_what_its_branch_computes_as_a_chain(precision):
    """Each node of a tree pass attends to its own keys laid out as its branch lays them out as a chain: its logits
    equal the chain's last row's, bit for bit, past the first block of keys too."""
    runtime = require_pass_invariant(LeanRuntime(tiny_llama(seed=0, init_range=0.5), precision))
    prefix = list(range(3, 63)) * 5  # 300 positions
    parents = [-1, 0, 0, 1, 1, 2, 3]
    for seed in range(3):
        tokens = torch.randint(3, 60, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        runtime.rollback(0)
        runtime.extend(prefix, 0)
        tree = runtime.extend_tree(tokens, parents)  # [7, vocab]
        for node in range(7):
            branch = [node]
            while parents[branch[-1]] >= 0:
                branch.append(parents[branch[-1]])
            runtime.rollback(len(prefix))
            assert torch.equal(runtime.extend([tokens[i] for i in branch[::-1]], 1)[0], tree[node]), (seed, node)

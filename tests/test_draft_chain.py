"""A draft model's whole chain in one C call (FusedRuntime.draft_chain, fused/chain.c): the tokens, alternatives,
cache and hidden states of the Python chain (one ``extend([token], 1)`` per token, the choice in exactspec.sampling),
bit for bit, greedy and under the invariant sampler; a head cut to some of the vocabulary's rows drafts among them
only; and the proposer takes the call only where the sampling is a choice it can make there.

Tiny random GGUFs (tests/tiny_gguf.py): a llama with 4-bit blocks (integer products) and a qwen2 with biases on q,
k and v in float16. Their vocabulary (49152 ids, 64 wide) makes a 12.6 MB float table, which the runtime makes
itself (``CHAIN_TABLE_BYTES``).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_gguf

from exactspec.backends import native
from exactspec.backends.base import CHAIN_LEAD, DraftsChains, declares
from exactspec.backends.fused import FusedRuntime
from exactspec.backends.fused import runtime as runtime_module
from exactspec.backends.fused.runtime import CHAIN_TABLE_BYTES, ChainVocabulary
from exactspec.backends.fused.stored import StoredMatrix
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.proposers import DraftModelProposer, NoProposer
from exactspec.proposers.draft_model import chain_noise
from exactspec.sampling import SamplingParams, gumbel_noise, ranked, scaled_logits

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))

SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 512}
FILES = {"llama": "Q4_0", "qwen2": "F16"}  # integer products over nibbles; float16 weights with q, k, v biases
PROMPT = [(53 * i) % 4000 + 7 for i in range(30)]
TEMPERATURES = (0.6, 1.0, 1.7)


@pytest.fixture(scope="module", params=list(FILES))
def path(request, tmp_path_factory) -> Path:
    arch = request.param
    return write_tiny_gguf(tmp_path_factory.mktemp("chain") / f"{arch}.gguf", seed=3, tensor_type=FILES[arch],
                           architecture=arch, **SHAPE)


def python_chain(proposer):
    """The proposer, made to chain in Python (one extend per token) whatever its model declares."""
    proposer._chains_in_one_call = lambda params: False
    return proposer


def same_cache(a: FusedRuntime, b: FusedRuntime) -> bool:
    """Whether two runtimes hold the same tokens and, at every cached position, the same keys and values, bit for bit
    (and the same kept hidden states, where they keep them)."""
    n = len(a.tokens)
    if a.tokens != b.tokens:
        return False
    for mine, theirs in zip(a._keys + a._values, b._keys + b._values):
        if not torch.equal(mine[:, :n], theirs[:, :n]):
            return False
    return a._hidden is None or torch.equal(a.hidden_states, b.hidden_states)


def rounds(seed: int):
    """Rounds of each draft length 1..8 in an order drawn from ``seed``, each with tree widths (1..3 a depth), an
    accepted prefix and a count of tokens another source drafted after it (none to more than a lead), drawn from it
    too."""
    draw = random.Random(seed)
    for k in draw.sample(range(1, 9), 8):
        yield [draw.randint(1, 3) for _ in range(k)], draw.randint(0, k), draw.choice([0, 0, 1, 3, CHAIN_LEAD + 3])


def run_both(path: Path, params: SamplingParams, seed: int, keep_hidden: bool = False) -> int:
    """Rounds of drafting by the one-call chain and the Python chain on two runtimes of one file, from a prompt on:
    each round's tokens and alternatives, then the caches, are the same; the context then takes the accepted prefix,
    one token of its own (what the target would add) and some a copy would have drafted, so the next round's chain
    rolls rejected tokens back and leads with 1 to CHAIN_LEAD tokens (after feeding a longer backlog first). The
    one-call rounds drafted."""
    one, two = FusedRuntime.from_gguf(path), FusedRuntime.from_gguf(path)
    if keep_hidden:
        one.keep_hidden_states(), two.keep_hidden_states()
    fast, slow = DraftModelProposer(one, one.vocab_size), python_chain(DraftModelProposer(two, two.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    context, drafted = list(PROMPT), 0
    for widths, accepted, copied in rounds(seed):
        assert fast._chains_in_one_call(params)
        mine, theirs = fast._chain(context, widths, params, generator), slow._chain(context, widths, params, generator)
        assert mine == theirs, (widths, context[-3:])
        assert same_cache(one, two)
        tokens = mine[0]
        context += tokens[:accepted] + [(tokens[-1] * 7 + seed + i) % 5000 for i in range(1 + copied)]
        drafted += 1
    return drafted


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_chain_in_one_call_is_the_python_chain_bit_for_bit(path, seed):
    """Greedy: each depth's argmax and its next best, after a prompt and after rollbacks of rejected tokens; the
    cache then holds the same keys and values at every position, and the same tokens."""
    assert run_both(path, SamplingParams(), seed) == 8


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_invariant_chain_in_one_call_is_the_python_chain_bit_for_bit(path, temperature):
    """The invariant sampler's Gumbel-max at each depth's position, over the noise the target will use there."""
    seed = TEMPERATURES.index(temperature) + 11
    assert run_both(path, SamplingParams(temperature=temperature, method="invariant"), seed) == 8


def test_kept_hidden_states_are_written_as_a_pass_writes_them(path):
    """A runtime that keeps hidden states (what eagle and mtp read) has the chain's positions' states, normed, as the
    Python chain's passes keep them."""
    run_both(path, SamplingParams(temperature=1.0, method="invariant"), 5, keep_hidden=True)


def test_gemma3_chains_in_one_call_and_gemma2s_capped_logits_in_python(tmp_path):
    """gemma 3 (a scaled embedding, which the chain's table holds as the runtime embeds it; sliding layers with RoPE
    of their own) drafts in one call what its Python chain drafts; gemma 2 caps its logits with torch's tanh, whose
    bits the C kernels do not reproduce, so it has no chain ids and its proposer chains in Python."""
    gemma3 = write_tiny_gguf(tmp_path / "gemma3.gguf", seed=3, tensor_type="Q8_0", architecture="gemma3", **SHAPE)
    assert run_both(gemma3, SamplingParams(temperature=0.9, method="invariant"), 3) == 8
    gemma2 = FusedRuntime.from_gguf(write_tiny_gguf(tmp_path / "gemma2.gguf", seed=3, tensor_type="Q8_0",
                                                    architecture="gemma2", **SHAPE))
    assert gemma2.chain_ids is None
    assert not DraftModelProposer(gemma2, gemma2.vocab_size)._chains_in_one_call(SamplingParams())


@pytest.mark.slow
def test_speculation_with_a_fused_draft_model_is_plain_decoding(path, tmp_path):
    """An engine whose draft model is a fused runtime (chaining in one call) emits plain decoding's tokens, greedy and
    seeded, in chains and trees: a draft of the target's own weights (every token accepted: bonus tokens, long
    syncs) and one of other weights (rejections: rollbacks each round)."""
    target = FusedRuntime.from_gguf(path)
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=4, tensor_type="Q8_0", architecture="llama", **SHAPE)
    drafts = [FusedRuntime.from_gguf(path), FusedRuntime.from_gguf(other)]
    calls = []
    for draft in drafts:
        chain = draft.draft_chain
        draft.draft_chain = lambda *args, chain=chain: calls.append(1) or chain(*args)
    for seed, sampling in enumerate((SamplingParams(), SamplingParams(temperature=0.8, method="invariant"))):
        config = GenerationConfig(max_new_tokens=20, sampling=sampling, seed=seed, num_draft_tokens=4,
                                  stop_at_eos=False)
        expected = Engine(target, NoProposer()).generate(PROMPT, config).token_ids
        for draft in drafts:
            for tree in (None, (3, 2, 1)):
                engine = Engine(target, DraftModelProposer(draft, target.vocab_size))
                assert engine.generate(PROMPT, replace(config, tree=tree)).token_ids == expected
    assert len(calls) >= 16


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:  # [rows] float64
    return scaled_logits(logits, SamplingParams(temperature=temperature, method="invariant")).double()


@pytest.mark.parametrize("temperature", (0.3, 0.77, 1.0, 2.9))
def test_the_choice_ties_where_pythons_does_at_every_row(path, temperature):
    """Noise that cancels Python's scaled logits exactly (every row's sum 0: a tie, which torch.argmax breaks to the
    lowest row) makes the chain choose row 0 at every depth, and the Python path's logits at each depth are the
    chain's: a row whose scaled logit C computed an ulp higher would win, as would any other row of row 0's ulp
    lower. So every row's float32 shift and division, and the float64 sum, are Python's bits."""
    runtime, reference = FusedRuntime.from_gguf(path), FusedRuntime.from_gguf(path)
    runtime.extend(PROMPT[:-1], 0)
    reference.extend(PROMPT[:-1], 0)
    noise, fed = [], PROMPT[-1]
    for _ in range(3):
        logits = reference.extend([fed], 1)[0]
        noise.append(-scaled(logits, temperature))
        fed = 0  # row 0's token, which the chain must choose
    tokens, _ = runtime.draft_chain([PROMPT[-1]], 3, 1, torch.stack(noise), temperature)
    assert tokens == [0, 0, 0]
    assert same_cache(runtime, reference)


def test_sampling_makes_the_same_scaled_logits_as_floats_in_c_would():
    """exactspec.sampling's scaled logits are, bit for bit, float32 (logit - max) / float32(temperature), 0 kept where
    the shift is 0: the arithmetic chain.c does (IEEE division in float32, no reciprocal)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50000, generator=generator) * 6
    for temperature in (0.1, 0.3, 0.77, 1.0, 1.3, 2.9, 1e-30):
        python = scaled_logits(logits, SamplingParams(temperature=temperature, method="invariant")).numpy()
        x = logits.numpy()
        shifted = x - x.max(-1, keepdims=True)
        with np.errstate(over="ignore", divide="ignore"):
            c = np.where(shifted == 0, shifted, shifted / np.float32(temperature))
        assert np.array_equal(python.view(np.uint32), c.view(np.uint32)), temperature


def test_chain_noise_is_the_targets_noise_at_the_heads_ids():
    """The noise the proposer hands the chain at each depth's position: the target's (over its whole vocabulary) at
    the head's ids, for a full head and for one that skips ids."""
    target = 5000
    for ids in (torch.arange(3000, dtype=torch.int32), torch.tensor([3, 17, 18, 2999], dtype=torch.int32)):
        noise = chain_noise(ids, 77, range(40, 43))
        expected = torch.stack([gumbel_noise(77, position, target)[ids.long()] for position in range(40, 43)])
        assert noise.dtype == torch.float64 and torch.equal(noise, expected)


def cut_head(runtime: FusedRuntime, groups: list[int]) -> torch.Tensor:
    """Cut the runtime's LM head to the blocks of 8 rows ``groups`` (ascending), as a draft-grade model's head keeps
    some of the vocabulary: the head's packed bytes of those blocks (StoredMatrix's layout: 8 rows a block), the chain
    vocabulary of their ids. The ids kept."""
    head = runtime._matrices[-1]
    assert head.rest is None and head.bias is None, "a one-part head"
    block = head.packed.numel() // -(-head.outputs // 8)  # its bytes (elements) per block of 8 rows
    packed = torch.cat([head.packed[g * block : (g + 1) * block] for g in groups])
    cut = StoredMatrix(head.format, 8 * len(groups), head.inputs, packed)
    runtime._cut_head = cut  # the Matrix points into its bytes
    runtime._model.lm_head = cut.struct(runtime.products)
    runtime._head = native.MatrixProduct(runtime._model.lm_head)
    ids = torch.tensor([8 * g + j for g in groups for j in range(8)])
    runtime.chain_vocabulary = ChainVocabulary.of(runtime, ids)
    return ids


@pytest.mark.parametrize("temperature", (0.0, 0.8))
def test_a_head_cut_to_some_rows_drafts_among_their_ids_only(path, temperature):
    """A head of some rows (whole blocks of 8, spread over the vocabulary): every drafted token and alternative is one
    of their ids, and each is the choice among the cut head's logits as Python makes it (argmax; or scaled logits
    plus the target's noise at those ids), fed as that id's embedding."""
    runtime, reference = FusedRuntime.from_gguf(path), FusedRuntime.from_gguf(path)
    groups = sorted(random.Random(0).sample(range(runtime.vocab_size // 8), 300))
    ids = cut_head(runtime, groups)
    assert torch.equal(cut_head(reference, groups), ids)
    params, seed, k = SamplingParams(temperature=temperature, method="invariant"), 9, 6
    for prompt in (PROMPT, PROMPT[:7]):
        runtime.rollback(0), reference.rollback(0)
        runtime.extend(prompt[:-1], 0), reference.extend(prompt[:-1], 0)
        noise = None if params.greedy else torch.stack(
            [gumbel_noise(seed, len(prompt) + i, runtime.vocab_size)[ids] for i in range(k)])
        tokens, alternatives = runtime.draft_chain([prompt[-1]], k, 3, noise, temperature or 1.0)
        expected, fed = [], prompt[-1]
        for depth in range(k):
            logits = reference.extend([fed], 1)[0]  # [300 * 8]: the cut head's rows
            assert logits.shape == ids.shape
            choice = logits if params.greedy else scaled(logits, temperature) + noise[depth]
            row = int(choice.argmax())
            expected.append(int(ids[row]))
            assert alternatives[depth] == [int(ids[r]) for r in ranked(logits, 2, exclude=row)]
            fed = expected[-1]
        assert tokens == expected
        assert set(tokens + sum(alternatives, [])) <= set(ids.tolist())
        assert same_cache(runtime, reference)


def test_the_proposer_chains_in_one_call_only_where_the_sampling_is_a_choice(path, monkeypatch):
    """Greedy and the invariant sampler without truncation: one call; the standard sampler (a draw with its
    distribution), or top-k or top-p: the Python chain. The runtime declares the capability; a model whose float
    table would be too large a copy (here: a limit of one byte) has no chain ids, and chains in Python."""
    runtime = FusedRuntime.from_gguf(path)
    assert declares(runtime, DraftsChains) and 4 * runtime.vocab_size * 64 <= CHAIN_TABLE_BYTES
    proposer = DraftModelProposer(runtime, runtime.vocab_size)
    assert proposer._chains_in_one_call(SamplingParams())
    assert proposer._chains_in_one_call(SamplingParams(temperature=0.7, method="invariant"))
    assert not proposer._chains_in_one_call(SamplingParams(temperature=0.7, method="standard"))
    assert not proposer._chains_in_one_call(SamplingParams(temperature=0.7, top_k=5, method="invariant"))
    assert not proposer._chains_in_one_call(SamplingParams(temperature=0.7, top_p=0.9, method="invariant"))
    monkeypatch.setattr(runtime_module, "CHAIN_TABLE_BYTES", 1)
    large = FusedRuntime.from_gguf(path)
    assert large.chain_ids is None
    assert not DraftModelProposer(large, large.vocab_size)._chains_in_one_call(SamplingParams())


def test_the_chain_refuses_what_it_cannot_take_in_one_line(path):
    runtime = FusedRuntime.from_gguf(path)
    runtime.extend(PROMPT[:-1], 0)
    for bad in ({"width": 17}, {"width": 0}, {"noise": torch.zeros(2, 5, dtype=torch.float64)},
                {"noise": torch.zeros(3, runtime.vocab_size, dtype=torch.float64), "temperature": 0.0}):
        with pytest.raises(UsageError):
            runtime.draft_chain([PROMPT[-1]], 3, **bad)
    assert runtime.tokens == PROMPT[:-1]  # nothing fed
    assert runtime.draft_chain([PROMPT[-1]], 0) == ([], [])


CHAIN_DIGEST = """
import hashlib, sys, torch
from exactspec.backends.fused import FusedRuntime
from exactspec.sampling import gumbel_noise
runtime = FusedRuntime.from_gguf(sys.argv[1])
runtime.extend(list(range(7, 37)), 0)
ids = runtime.chain_ids.long()
noise = torch.stack([gumbel_noise(4, 31 + i, runtime.vocab_size)[ids] for i in range(8)])
drafted = [runtime.draft_chain([36], 8, 3), runtime.draft_chain([5], 8, 3, noise, 0.9)]
digest = hashlib.sha256(repr(drafted).encode())
for tensor in runtime._keys + runtime._values:
    digest.update(tensor[:, : len(runtime.tokens)].contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


def test_the_avx2_tiles_draft_the_same_chain(path):
    """The chain on the AVX2 tiles (an AVX2-only EPYC's, forced by EXACTSPEC_FUSED_AVX2=1) drafts this CPU's own
    tokens and writes its cache's bits (test_cpu_paths.py runs this file's bit-for-bit tests on every path)."""
    from test_cpu_paths import AVX2_TILES, run_here

    runs = [run_here(["-c", CHAIN_DIGEST, str(path)], env, 300) for env in ({}, AVX2_TILES)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.split()) == 1



@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chain_across_tokenizers_in_one_call_is_its_python_chain(tmp_path, temperature):
    """A draft model with another tokenizer than the target's, drafting among the tokens both hold (intersection):
    its chain in one call (the head's rows allowed where their tokens are shared, each mapped to the target's id;
    the invariant sampler's noise at the target's ids and positions) proposes what its Python chain does, tokens and
    a tree's alternatives, greedy and seeded."""
    from tiny_vocabularies import sentencepiece_fields

    from exactspec.backends.fused import FusedRuntime
    from exactspec.models import load_tokenizer
    from exactspec.proposers.draft_model import ForeignDraft, ForeignDraftProposer
    from exactspec.vocabularies import ContextBridge, TokenText

    fields, _ = sentencepiece_fields(order_seed=5)
    target_path = write_tiny_gguf(tmp_path / "target.gguf", tokenizer=fields, seed=1)
    draft_path = write_tiny_gguf(tmp_path / "draft.gguf", seed=2)  # the default model's byte-level BPE
    target_text, draft_text = TokenText(*load_tokenizer(target_path)), TokenText(*load_tokenizer(draft_path))
    target_vocab = load_tokenizer(target_path)[1]
    context = target_text.encode(b"the prime numbers below twenty are two three five")[0]
    params = SamplingParams(temperature=temperature)
    drafts = {}
    for one_call in (True, False):
        runtime = FusedRuntime.from_gguf(draft_path)
        source = ForeignDraft(runtime, ContextBridge(target_text, draft_text), method="intersection")
        proposer = ForeignDraftProposer(source, target_vocab_size=target_vocab)
        if not one_call:
            python_chain(proposer)
        generator = torch.Generator().manual_seed(3)
        drafts[one_call] = [proposer.propose_tree(context[:n], [2, 2, 1, 1], params, generator)
                            for n in (len(context) - 3, len(context))]
    assert runtime.chain_ids is not None
    for one, python in zip(drafts[True], drafts[False]):
        assert one.tokens == python.tokens and one.parents == python.parents and len(one.tokens) > 4

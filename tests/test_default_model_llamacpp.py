"""The default model on llama.cpp (its GGUF, Q4_1 as stored), greedy: specdec's decoding against
llama-cpp-python's own greedy ``generate`` of the same file, token for token, for plain decoding and each drafter.

A parting is allowed only at a near-tie of llama.cpp's own numerics: its logits for one position differ between
passes that group positions differently (one row or several; where the cache's cells lie), its activations being
quantised to 8 bits per row and its KV cache float16. Measured on MT-bench over the whole vocabulary
(docs/benchmarks.md, "Do llama.cpp's logits depend on the pass?"), by the size of the pass: up to 1.09, 1.12,
1.14, 1.30 and 1.51 for 2, 3, 5, 8 and 16 positions. Two runs may then part only where the top two logits are
within twice the bound for the largest pass a drafter can make (k+1 positions). Any other parting is a logic
error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from specdec.api import SpecDecoder  # noqa: E402
from specdec.engine import GenerationConfig  # noqa: E402
from specdec.models import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow

MT_BENCH = Path(__file__).resolve().parents[1] / "data" / "mt_bench_question.jsonl"
NUM_PROMPTS = 8
NEW_TOKENS = 48
PASS_DIFFERENCE = {2: 1.09, 3: 1.12, 5: 1.14, 8: 1.30, 16: 1.51}  # positions in a pass -> largest logit difference
AUTO_MAX_POSITIONS = 17  # -k auto drafts up to 16


def near_tie(positions: int) -> float:
    """Twice the logit difference measured for passes of ``positions`` (the next size measured up; the largest
    measured beyond it)."""
    sizes = [n for n in PASS_DIFFERENCE if n >= positions] or [max(PASS_DIFFERENCE)]
    return 2 * PASS_DIFFERENCE[min(sizes)]


NEAR_TIE = near_tie(AUTO_MAX_POSITIONS)  # any pass, every row an output included (eagle, mtp)


@pytest.fixture(scope="module")
def decoder() -> SpecDecoder:
    return SpecDecoder.load(drafter="none", backend="llama.cpp", threads=2)


@pytest.fixture(scope="module")
def reference(decoder):  # a context of the same size, threads and batch as the decoder's
    return llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=decoder.engine.target.max_length,
                           n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, verbose=False)


@pytest.fixture(scope="module")
def prompts(decoder) -> list[list[int]]:
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:NUM_PROMPTS]]
    return [decoder.encode(q["turns"][0]) for q in questions]


def llama_cpp_greedy(llama, prompt: list[int], eos: frozenset[int]) -> list[int]:
    """llama-cpp-python's greedy output, in specdec's passes: the prompt but its last token in one, then one each."""
    llama.reset()
    llama.eval(prompt[:-1])  # generate() then reuses this prefix and evaluates the last prompt token alone
    tokens = []
    for token in llama.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
        tokens.append(int(token))
        if token in eos or len(tokens) == NEW_TOKENS:
            return tokens
    return tokens


def parting_margin(decoder: SpecDecoder, prompt: list[int], expected: list[int], got: list[int]) -> float | None:
    """None when the two agree; else the top-two logit gap, in a plain pass, where they first part."""
    if got == expected:
        return None
    i = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    target = decoder.engine.target
    target.rollback(0)
    top = target.extend(prompt + expected[:i], 1)[0].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("drafter,k", [("none", 1), ("prompt-lookup", 4), ("prompt-lookup", "auto"),
                                       ("retrieval", 4)])
def test_greedy_output_is_llama_cpp_pythons_own_up_to_near_ties(decoder, reference, prompts, drafter, k):
    spec = SpecDecoder(decoder.target, drafter=drafter)
    eos = spec.engine.eos_token_ids
    margins = []
    for prompt in prompts:
        expected = llama_cpp_greedy(reference, prompt, eos)
        decoder.engine.target.rollback(0)  # the prompt in one pass, as llama-cpp-python's, not on a cached prefix
        got = spec.generate_ids(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=k)).token_ids
        margin = parting_margin(decoder, prompt, expected, got)
        if margin is not None:
            margins.append(margin)
    bound = near_tie(AUTO_MAX_POSITIONS if k == "auto" else k + 1)
    assert all(m < bound for m in margins), f"partings at top-two gaps {margins}"
    if drafter == "none":  # the same passes as the reference's, so no parting at all
        assert margins == []


def accepted_within_near_ties(spec: SpecDecoder, decoder, reference, prompts) -> int:
    """Accepted draft tokens over the prompts, each output checked against llama-cpp-python's greedy output up to
    near-ties."""
    accepted = 0
    for prompt in prompts:
        result = spec.generate_ids(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=3))
        expected = llama_cpp_greedy(reference, prompt, spec.engine.eos_token_ids)
        margin = parting_margin(decoder, prompt, expected, result.token_ids)
        assert margin is None or margin < NEAR_TIE
        accepted += result.stats.accepted_tokens
    return accepted


def test_the_shipped_draft_lm_drafts_for_llama_cpp(decoder, reference, prompts):
    spec = SpecDecoder(decoder.target, drafter="draft-model")  # the draft LM trained for this target
    assert accepted_within_near_ties(spec, decoder, reference, prompts[:3]) > 0


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_the_shipped_feature_drafters_read_llama_cpps_hidden_states(decoder, reference, prompts, drafter):
    """eagle and mtp, trained on the torch model's normed final states, draft from llama.cpp's (its embeddings),
    are accepted, and keep llama-cpp-python's greedy output up to near-ties."""
    spec = SpecDecoder.load(drafter=drafter, backend="llama.cpp", threads=2)  # its own context: embeddings on
    assert accepted_within_near_ties(spec, decoder, reference, prompts[:3]) > 0

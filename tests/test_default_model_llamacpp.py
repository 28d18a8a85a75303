"""The default model on llama.cpp (its GGUF, Q4_1 as stored), greedy: exactspec's decoding against
llama-cpp-python's own greedy ``generate`` of the same file, token for token, for plain decoding and each drafter.

No parting is allowed. With flash attention (exactspec's contexts and the reference's alike), llama.cpp computes
each row of a pass as it computes that row alone, whatever the pass's size and whichever rows are outputs, for
the default model's quantised weights (docs/exactness.md): a drafter can change how positions are grouped into
passes, never a logit, so never a token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from exactspec.api import SpecDecoder  # noqa: E402
from exactspec.engine import GenerationConfig  # noqa: E402
from exactspec.models import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow

MT_BENCH = Path(__file__).resolve().parents[1] / "data" / "mt_bench_question.jsonl"
NUM_PROMPTS = 8
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def decoder() -> SpecDecoder:
    return SpecDecoder.load(drafter="none", backend="llama.cpp", threads=2)


@pytest.fixture(scope="module")
def reference(decoder):  # a context of the same size, threads and batch as the decoder's
    return llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=decoder.engine.target.max_length,
                           n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False)


@pytest.fixture(scope="module")
def prompts(decoder) -> list[list[int]]:
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:NUM_PROMPTS]]
    return [decoder.encode(q["turns"][0]) for q in questions]


@pytest.fixture(scope="module")
def expected(reference, decoder):
    """llama-cpp-python's greedy output of a prompt, generated once for the tests that compare with it."""
    outputs: dict[tuple[int, ...], list[int]] = {}

    def of(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in outputs:
            outputs[tuple(prompt)] = llama_cpp_greedy(reference, prompt, decoder.engine.eos_token_ids)
        return outputs[tuple(prompt)]

    return of


def llama_cpp_greedy(llama, prompt: list[int], eos: frozenset[int]) -> list[int]:
    """llama-cpp-python's greedy output, in exactspec's passes: the prompt but its last token in one, then one each."""
    llama.reset()
    llama.eval(prompt[:-1])  # generate() then reuses this prefix and evaluates the last prompt token alone
    tokens = []
    for token in llama.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
        tokens.append(int(token))
        if token in eos or len(tokens) == NEW_TOKENS:
            return tokens
    return tokens


@pytest.mark.parametrize("drafter,k", [("none", 1), ("prompt-lookup", 4), ("prompt-lookup", "auto"),
                                       ("retrieval", 4)])
def test_greedy_output_is_llama_cpp_pythons_own(decoder, expected, prompts, drafter, k):
    spec = SpecDecoder(decoder.target, drafter=drafter)
    assert spec.engine.eos_token_ids == decoder.engine.eos_token_ids  # what the expected outputs stopped at
    for prompt in prompts:
        want = expected(prompt)
        decoder.engine.target.rollback(0)  # the prompt in one pass, as llama-cpp-python's, not on a cached prefix
        got = spec.generate_ids(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=k)).token_ids
        assert got == want


def accepted_keeping_greedy_output(spec: SpecDecoder, expected, prompts) -> int:
    """Accepted draft tokens over the prompts, each output equal to llama-cpp-python's greedy output."""
    accepted = 0
    for prompt in prompts:
        result = spec.generate_ids(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=3))
        assert result.token_ids == expected(prompt)
        accepted += result.stats.accepted_tokens
    return accepted


def test_the_shipped_draft_lm_drafts_for_llama_cpp(decoder, expected, prompts):
    spec = SpecDecoder(decoder.target, drafter="draft-model")  # the draft LM trained for this target
    assert accepted_keeping_greedy_output(spec, expected, prompts[:3]) > 0


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_the_shipped_feature_drafters_read_llama_cpps_hidden_states(decoder, expected, prompts, drafter):
    """eagle and mtp, trained on the torch model's normed final states, draft from llama.cpp's (its embeddings),
    are accepted, and keep llama-cpp-python's greedy output."""
    spec = SpecDecoder.load(drafter=drafter, backend="llama.cpp", threads=2)  # its own context: embeddings on
    assert accepted_keeping_greedy_output(spec, expected, prompts[:3]) > 0

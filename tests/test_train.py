"""Trained drafters on a tiny target: training learns, files round-trip, exactness holds, wrong targets are refused,
published layouts load."""

from __future__ import annotations

import json
import multiprocessing
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from scipy.stats import chisquare
from tiny import save_with_tokenizer, structured_llama, tiny_llama, trained_samples

from exactspec.api import SpecDecoder
from exactspec.cli import main
from exactspec.drafters import checkpoint
from exactspec.drafters.layers import LayerShape
from exactspec.drafters.networks import METHODS, DrafterConfig, ExitAdapter, TargetParts
from exactspec.engine import GenerationConfig
from exactspec.errors import UsageError
from exactspec.models import load_model
from exactspec.sampling import SamplingParams

TRAIN_ARGS = ["--prompts", "160", "--max-new-tokens", "24", "--epochs", "8", "--batch-tokens", "512",
              "--eval-every", "20", "--draft-vocab", "48", "--heldout", "16", "--layers", "1", "--lr", "3e-3",
              "--threads", "1"]
METHOD_ARGS = {"early-exit": ["--exit-layer", "1"]}  # the tiny target's first of its two layers drafts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A structured tiny target, its training prompts, and one trained drafter per method (one shared data dir)."""
    root = tmp_path_factory.mktemp("trained")
    target = save_with_tokenizer(structured_llama(0), root / "target")
    rng = random.Random(0)
    prompts = root / "prompts.txt"
    prompts.write_text("\n\n".join(" ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randrange(2, 6)))
                                   for _ in range(200)))
    drafters = {}
    for method in METHODS:
        drafters[method] = root / method
        # the draft LM starts from random weights: the target's first layer alone already follows the graph
        assert main(["train", "--method", method, "--target", str(target), "--out", str(drafters[method]),
                     "--data", str(prompts), "--data-dir", str(root / "data"), *TRAIN_ARGS,
                     "--no-init-from-target", *METHOD_ARGS.get(method, [])]) == 0
    return {"target": target, "prompts": prompts, "root": root, **drafters}


def assert_it_learned(curve: list[dict]) -> None:
    before, after = curve[0], curve[-1]
    assert before["step"] == 0 and after["step"] > 0
    assert after["loss"] < curve[1]["loss"]  # the first loss is recorded at the first evaluation after step 0
    # held-out agreement: mean over draft positions, before any step and at the end; 16 held-out answers of up to
    # 24 tokens: a rise of 0.1 is far beyond the noise of a fixed held-out set (it is deterministic)
    mean = lambda rates: sum(rates) / len(rates)  # noqa: E731
    assert mean(after["heldout_agreement"]) > mean(before["heldout_agreement"]) + 0.1, curve


@pytest.mark.parametrize("method", [m for m in METHODS if m != "early-exit"])
def test_training_lowers_the_loss_and_raises_heldout_agreement(trained, method):
    assert_it_learned(json.loads((trained[method] / "drafter.json").read_text())["training"]["curve"])


def test_an_exit_adapter_learns_what_the_plain_early_exit_misses(trained, tmp_path):
    """On the structured target the first layer's plain exit already agrees ~99% with the output (the graph is
    learnt there), so the adapter is trained here on a random target, whose exit after layer 1 of 2 agrees a
    third of the time. Step 0's agreement is the plain exit's (test_an_untrained_exit_adapter_is_the_plain_exit)."""
    target = save_with_tokenizer(tiny_llama(0, layers=2, init_range=0.5), tmp_path / "target")
    assert main(["train", "--method", "early-exit", "--exit-layer", "1", "--target", str(target), "--out",
                 str(tmp_path / "exit"), "--data", str(trained["prompts"]), "--data-dir", str(tmp_path / "data"),
                 "--prompts", "160", "--max-new-tokens", "24", "--epochs", "16", "--batch-tokens", "512",
                 "--eval-every", "20", "--draft-vocab", "48", "--heldout", "16", "--layers", "2", "--lr", "1e-2",
                 "--threads", "1"]) == 0
    assert checkpoint.load(tmp_path / "exit", "early-exit", load_model(target).model).config.exit_layer == 1
    assert_it_learned(json.loads((tmp_path / "exit" / "drafter.json").read_text())["training"]["curve"])


def test_an_untrained_exit_adapter_is_the_plain_exit():
    """Before training, the adapter hands the LM head what the target's own final norm would: the plain exit."""
    model = tiny_llama(3, layers=2, init_range=0.5)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    config = DrafterConfig(method="early-exit", shape=LayerShape.of(model.config), vocab_size=64, layers=2,
                           exit_layer=1)
    adapter = ExitAdapter(config, TargetParts.of(model))
    states = torch.randn(5, 32) * 3
    with torch.no_grad():
        torch.testing.assert_close(adapter(states), model.model.norm(states))


def test_token_reading_mtp_heads_start_as_feature_heads_and_read_the_token():
    """exactspec's mtp heads read [embedding of token t+1; feature t]; untrained, they are Medusa's heads on the
    feature alone (the same blocks give the same logits), and once the input layer learns, the token matters."""
    from exactspec.drafters.networks import MTPHeads

    model = tiny_llama(4)
    parts = TargetParts.of(model)
    config = DrafterConfig(method="mtp", shape=LayerShape.of(model.config), vocab_size=64, heads=2)
    torch.manual_seed(0)
    feature_only = MTPHeads(config, parts)
    reading = MTPHeads(replace(config, token_input=True), parts)
    reading.heads.load_state_dict(feature_only.heads.state_dict())
    with torch.no_grad():
        for block in reading.heads.parameters():
            block.normal_(0, 0.3)
        feature_only.heads.load_state_dict(reading.heads.state_dict())
        features, tokens = torch.randn(5, 32), torch.randint(0, 64, (5,))
        torch.testing.assert_close(reading(features, tokens), feature_only(features))
        reading.fc.weight[:, :32].normal_(0, 0.3)  # the embedding's half, zero at the start
        assert not torch.allclose(reading(features, tokens), reading(features, (tokens + 1) % 64))
    assert feature_only.config.token_input is False and not hasattr(feature_only, "fc")
    with pytest.raises(ValueError, match="next_tokens"):
        reading(features)


TREES = {"eagle": (3, 2), "mtp": (3, 2), "draft-model": (3, 2)}  # drafters of token trees, and a tree for each


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.95)],
                         ids=["greedy", "seeded-0.7"])
@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_a_trained_drafter_gives_plain_decodings_tokens(trained, method, sampling):
    """Chains of 1, 3 and 5 tokens and, for the drafters of trees, trees of those depths: greedy, and seeded at
    temperature 0.7 with the invariant sampler (the drafter proposes under the target's noise)."""
    target = load_model(trained["target"])
    plain = SpecDecoder(target, drafter="none")
    speculative = SpecDecoder(target, drafter=method, drafter_path=trained[method])
    drafts = [(k, None) for k in (1, 3, 5)] + ([(1, (4,)), (3, TREES[method]), (5, (2, 1))] if method in TREES
                                              else [])
    accepted = 0
    for seed, prompt in enumerate(([5, 9], [17, 4, 33], [60, 61, 62, 63, 3], list(range(3, 40)))):
        for k, tree in drafts:
            config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k, stop_at_eos=False, tree=tree,
                                      sampling=sampling, seed=seed)
            result = speculative.generate_ids(prompt, config)
            expected = plain.generate_ids(prompt, replace(config, tree=None)).token_ids
            assert result.token_ids == expected, (method, prompt, k, tree)
            accepted += result.stats.accepted_tokens
    assert accepted > 0  # the drafts were used, not all refused


def test_self_speculation_runs_each_position_once_through_the_shared_layers(trained, monkeypatch):
    """The early exit drafts with the target's first layer; the verifying pass starts past it for the drafted
    positions. Over a whole generation, as many positions pass the first layer as pass the last (none twice),
    and drafts were both kept and refused."""
    from exactspec.backends.lean import LeanRuntime

    through = {"first": 0, "last": 0}
    layers = LeanRuntime.run_layers

    def counted(self, x, first, end, *rest):
        through["first"] += x.shape[0] if first == 0 else 0
        through["last"] += x.shape[0] if end == self.num_layers else 0
        return layers(self, x, first, end, *rest)

    monkeypatch.setattr(LeanRuntime, "run_layers", counted)
    decoder = SpecDecoder(load_model(trained["target"]), drafter="early-exit", drafter_path=trained["early-exit"])
    sampling = SamplingParams(temperature=1.0)
    stats = [decoder.engine.generate([5, 9, 17], GenerationConfig(max_new_tokens=40, num_draft_tokens=3,
                                                                 sampling=sampling, seed=seed)).stats
             for seed in range(3)]
    assert through["first"] == through["last"] > 0
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)


@pytest.mark.slow  # over 10 s on 2 cores
def test_sampling_with_trained_drafters_is_exact(trained):
    """The first three tokens at temperature 0.9, top-p 0.95 under each trained drafter (k=2), and under eagle's
    tree, against the exact joint distribution of the target: 3,000 samples per configuration, one
    chi-square test each at alpha = 0.001 (a correct engine fails one of the five with probability under 0.5%;
    the seeds are fixed). Over its 8 outcomes, each test catches with probability 0.99 a sampler at a chi-square
    distance of 0.015 from the exact joint, so any that moves a total variation of 0.06 of the mass (6,000 samples
    caught 0.008, 0.04, in twice the time)."""
    from test_engine import bin_counts, exact_joint_of_first_three

    sampling = {"temperature": 0.9, "top_p": 0.95}
    prompt = (5, 9, 17)
    samples = 3000
    target = load_model(trained["target"]).model
    exact = exact_joint_of_first_three(SamplingParams(**sampling), list(prompt), target)
    bins = [outcome for outcome, p in exact.items() if p * samples >= 5]
    expected = np.array([exact[b] for b in bins] + [1 - sum(exact[b] for b in bins)]) * samples
    merge_rest = expected[-1] < 5  # too little mass outside the bins for a bin of its own: it joins the last
    if merge_rest:
        expected = np.append(expected[:-2], expected[-2] + expected[-1])
    configs = [(m, None) for m in METHODS] + [("eagle", TREES["eagle"])]
    half = samples // 2  # two jobs a configuration: the two workers finish together
    jobs = [(str(trained["target"]), str(trained[m]), m, sampling, half, 10_000 * i + first, prompt, 2, tree)
            for i, (m, tree) in enumerate(configs) for first in (0, half)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        halves = pool.starmap(trained_samples, jobs)
    results = [halves[i] + halves[i + 1] for i in range(0, len(halves), 2)]
    assert len(bins) >= 8 and (merge_rest or expected[-1] < 0.2 * samples)
    for method, drawn in zip(configs, results):
        observed = bin_counts(drawn, bins)
        if merge_rest:
            observed = np.append(observed[:-2], observed[-2] + observed[-1])
        assert chisquare(observed, expected).pvalue > 1e-3, method
    # and the drafters both accepted and rejected at this temperature: the test covers both paths
    decoder = SpecDecoder(load_model(trained["target"]), drafter="eagle", drafter_path=trained["eagle"])
    stats = [decoder.engine.generate(list(prompt), GenerationConfig(
        max_new_tokens=3, num_draft_tokens=2, sampling=SamplingParams(**sampling), seed=s, stop_at_eos=False)).stats
        for s in range(60)]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)


@pytest.mark.parametrize("method", METHODS)
def test_save_and_load_round_trip(trained, method, tmp_path):
    target = load_model(trained["target"]).model
    loaded = checkpoint.load(trained[method], method, target)
    checkpoint.save(loaded, tmp_path / "again")
    again = checkpoint.load(tmp_path / "again", method, target)
    assert again.config == loaded.config
    for (name, a), (_, b) in zip(loaded.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert set(p.name for p in trained[method].iterdir()) <= {"drafter.json", "drafter.safetensors",
                                                               "checkpoint.json", "checkpoint.safetensors"}
    training = json.loads((trained[method] / "drafter.json").read_text())["training"]
    assert training["command"].startswith("exactspec train --method " + method)
    assert training["data"]["seed"] == 0 and training["settings"]["seed"] == 0


def test_a_drafter_loads_onto_its_target_in_any_precision(trained):
    for dtype in ("bfloat16", "float16"):
        target = load_model(trained["target"], dtype=dtype).model
        assert checkpoint.load(trained["eagle"], "eagle", target) is not None


def test_a_drafter_for_another_target_is_refused(trained, tmp_path, capsys):
    other = save_with_tokenizer(tiny_llama(seed=5), tmp_path / "other")
    capsys.readouterr()  # saving reports progress on stderr
    code = main(["generate", "w5 w9", "--model", str(other), "--drafter", "eagle", "--drafter-path",
                 str(trained["eagle"])])
    err = capsys.readouterr().err
    assert code == 2 and "trained for another target" in err and err.count("\n") == 1


def test_resume_continues_from_the_checkpoint(trained, tmp_path):
    out = tmp_path / "run"
    common = ["train", "--method", "mtp", "--target", str(trained["target"]), "--out", str(out), "--data",
              str(trained["prompts"]), "--data-dir", str(trained["root"] / "data"), *TRAIN_ARGS]
    assert main([*common, "--epochs", "1"]) == 0
    first = json.loads((out / "checkpoint.json").read_text())["progress"]
    assert main([*common, "--epochs", "2", "--resume"]) == 0
    second = json.loads((out / "checkpoint.json").read_text())["progress"]
    assert second["step"] > first["step"] and second["curve"][: len(first["curve"])] == first["curve"]
    assert second["tokens"] > first["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "--epochs must be > 0"),
    (["--resume"], "no checkpoint"),
    (["--method", "medusa"], "invalid choice"),
    (["--conversations", "-1"], "--conversations must be >= 0"),
    (["--exit-layer", "1"], "--exit-layer is for --method early-exit"),
    (["--method", "early-exit"], "needs --exit-layer L"),
    (["--method", "early-exit", "--exit-layer", "2"], "--exit-layer must be in 1..1"),
])
def test_bad_training_input_is_one_line(trained, tmp_path, capsys, args, message):
    base = {"--method": "eagle", "--target": str(trained["target"]), "--out": str(tmp_path / "x")}
    for flag in args[::2]:
        base.pop(flag, None)
    argv = ["train", *[a for pair in base.items() for a in pair], *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_training_adds_the_fed_conversations(trained, tmp_path, capsys):
    """``--conversations N`` trains on N fed sequences beside the target's answers (held-out: the target's answers
    only); data without answers to feed is refused in one line."""
    rng = random.Random(2)
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 64)}" for _ in range(3)),
                                           "answer": " ".join(f"w{rng.randrange(3, 64)}" for _ in range(9))}) + "\n"
                               for _ in range(60)))
    common = ["train", "--method", "eagle", "--target", str(trained["target"]), "--out", str(tmp_path / "run"),
              "--data-dir", str(tmp_path / "data"), *TRAIN_ARGS, "--prompts", "30", "--heldout", "3", "--epochs", "1"]
    assert main([*common, "--data", str(records), "--conversations", "20"]) == 0
    data = json.loads((tmp_path / "run" / "drafter.json").read_text())["training"]["data"]
    assert (data["sequences"], data["fed_sequences"], data["heldout_sequences"]) == (27, 20, 3)
    capsys.readouterr()
    assert main([*common, "--data", str(trained["prompts"]), "--conversations", "4"]) == 2
    err = capsys.readouterr().err
    assert "no prompts with an answer" in err and err.count("\n") == 1


def test_the_datas_own_answers_are_fed_to_the_target_as_written(tmp_path):
    """``answers="data"``: each sequence is a prompt followed by the record's own answer (cut, or closed by the stop
    id); its features and log-sum-exp are the target's own at every fed position; the exchanges come from the far
    end of the shuffled data, apart from the prompts the target answers."""
    from exactspec.backends import make_backend
    from exactspec.train import loop, targetdata

    target_dir = save_with_tokenizer(structured_llama(0), tmp_path / "target")
    target = load_model(str(target_dir))
    rng = random.Random(1)
    words = lambda n: " ".join(f"w{rng.randrange(3, 64)}" for _ in range(n))  # noqa: E731
    records = [{"prompt": words(rng.randrange(2, 6)), "answer": words(rng.randrange(1, 12))} for _ in range(40)]
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    fed = targetdata.DataSlice(sources=(str(data),), prompts=12, max_new_tokens=8, answers="data")
    runtime = make_backend(target.model, "float32")
    eos = {target.tokenizer.eos_token_id}
    targetdata.build(runtime, target.tokenizer, eos, fed, tmp_path / "fed", "tiny", batch_size=4)
    sequences = loop.sequences_of(targetdata.load_shards(tmp_path / "fed"))
    answers = {r["prompt"]: r["answer"] for r in records}
    encode = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert len(sequences) == 12
    for sequence in sequences:
        prompt_ids = sequence.tokens[: sequence.prompt_length].tolist()
        answer = encode(answers[target.tokenizer.decode(prompt_ids, skip_special_tokens=True)])
        expected = answer[:8] if len(answer) >= 8 else answer + [target.tokenizer.eos_token_id]
        assert sequence.tokens[sequence.prompt_length :].tolist() == expected
        with torch.no_grad():
            out = target.model(sequence.tokens[None, :-1], output_hidden_states=True)
        torch.testing.assert_close(sequence.features[:-1].float(), out.hidden_states[-1][0], atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(sequence.lse[:-1], torch.logsumexp(out.logits[0].float(), -1), atol=1e-3, rtol=0)
    answered = targetdata.select(target.tokenizer, targetdata.DataSlice(sources=(str(data),), prompts=12), eos)
    assert not {tuple(ids) for ids, _ in answered} & {tuple(s.tokens[: s.prompt_length].tolist()) for s in sequences}


# published layouts --------------------------------------------------------------------------------------------


def _eagle1_reference(state: dict, config, target, features: torch.Tensor, next_tokens: torch.Tensor
                      ) -> torch.Tensor:
    """EAGLE-1's head computed with transformers' own llama layer: fc over [embedding; feature], one decoder layer
    whose input norm is the identity, no final norm. features [1, T, H], next_tokens [1, T] -> [1, T, H]."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    x = torch.nn.functional.linear(torch.cat([target.get_input_embeddings().weight[next_tokens], features], -1),
                                   state["fc.weight"], state["fc.bias"])
    t = x.shape[1]
    position_ids = torch.arange(t)[None]
    cos_sin = LlamaRotaryEmbedding(config)(x, position_ids)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


def test_a_published_eagle1_checkpoint_loads(tmp_path):
    target = tiny_llama(seed=2)
    config = target.config
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "embed_tokens.weight": (config.vocab_size, h),
              "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.self_attn.k_proj.weight": (kv, h),
              "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, h),
              "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
              "layers.0.mlp.down_proj.weight": (h, inter), "layers.0.post_attention_layernorm.weight": (h,)}
    state = {name: torch.randn(shape, generator=g) * 0.3 for name, shape in shapes.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "bias": True}))
    head = checkpoint.load(tmp_path, "eagle", target)
    features = torch.randn(1, 5, h, generator=g)
    tokens = torch.randint(0, config.vocab_size, (1, 5), generator=g)
    with torch.no_grad():
        expected = _eagle1_reference(state, config, target, features, tokens)
        assert torch.allclose(head(features, tokens), expected, atol=1e-5)


def test_a_published_medusa_checkpoint_loads(tmp_path):
    target = tiny_llama(seed=2)
    h, vocab = target.config.hidden_size, target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    state = {}
    for i in range(3):
        state[f"{i}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.3
        state[f"{i}.0.linear.bias"] = torch.randn(h, generator=g) * 0.3
        state[f"{i}.1.weight"] = torch.randn(vocab, h, generator=g) * 0.3
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1,
                                                      "base_model_name_or_path": "tiny"}))
    heads = checkpoint.load(tmp_path, "mtp", target)
    x = torch.randn(4, h, generator=g)
    with torch.no_grad():
        got = heads(x)  # [3, 4, vocab]
    for i in range(3):
        hidden = x + torch.nn.functional.silu(x @ state[f"{i}.0.linear.weight"].T + state[f"{i}.0.linear.bias"])
        assert torch.allclose(got[i], hidden @ state[f"{i}.1.weight"].T, atol=1e-4)


def test_pickled_checkpoints_are_refused(tmp_path):
    target = tiny_llama(seed=2)
    (tmp_path / "config.json").write_text(json.dumps(target.config.to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(UsageError, match="pickle"):
        checkpoint.load(tmp_path, "eagle", target)


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens():
    from exactspec.train.command import draft_vocabulary
    from exactspec.train.loop import Sequence

    tokens = torch.tensor([9, 9, 5, 5, 5, 7, 7, 7, 7, 8])
    sequence = Sequence(tokens=tokens, features=torch.zeros(10, 2), lse=torch.zeros(10), prompt_length=2)
    assert draft_vocabulary([sequence], 16, 3, {1}).tolist() == [1, 5, 7]  # stop id, then 7 (4x), 5 (3x)
    assert draft_vocabulary([sequence], 16, 0, {1}) is None
    assert draft_vocabulary([sequence], 16, 6, set()).tolist() == [0, 1, 2, 5, 7, 8]  # then the lowest ids


def test_the_bigram_baseline_drafts_each_tokens_most_frequent_successor():
    from exactspec.train.loop import Sequence, bigram_agreement

    def sequence(tokens: list[int]) -> Sequence:
        return Sequence(tokens=torch.tensor(tokens), features=torch.zeros(len(tokens), 2),
                        lse=torch.zeros(len(tokens)), prompt_length=1)

    # successors in training: 0 -> 1; 1 -> 2 (twice), 3 (once); 2 -> 1
    # held-out 0 1 2 1 3: first draft right at 0, 1, 2, wrong at 1 (3 follows); second right after 0 and 1
    assert bigram_agreement([sequence([0, 1, 2, 1, 2, 1, 3])], [sequence([0, 1, 2, 1, 3])]) == [3 / 4, 2 / 3]


def test_learning_curves_are_drawn_from_the_drafters_files(trained, tmp_path):
    from exactspec.bench.figures import plot_learning_curves

    path = plot_learning_curves([trained[m] for m in METHODS], tmp_path / "curves.png")
    assert path.stat().st_size > 10_000

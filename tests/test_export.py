"""``exactspec export``: trained drafters written in EAGLE-1's and Medusa-1's layouts, read back by exactspec with the
same drafts; refusals in one line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_with_tokenizer, tiny_llama

from exactspec.cli import main
from exactspec.drafters import checkpoint
from exactspec.drafters.export import export
from exactspec.drafters.files import DRAFT_VOCAB_FILE
from exactspec.drafters.layers import LayerShape
from exactspec.drafters.networks import DrafterConfig, EagleHead, MTPHeads, TargetParts
from exactspec.models import load_model, weight_probe


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_llama(seed=0, init_range=0.5)
    directory = save_with_tokenizer(model, tmp_path_factory.mktemp("export") / "target")
    return load_model(str(directory), dtype="float32", backend="lean").model, directory


def trained(method: str, target_model, directory, draft_vocab: int = 0, **options):
    """A drafter as exactspec train saves it (random weights, seed 0), over ``draft_vocab`` ids when given."""
    torch.manual_seed(0)
    vocab = target_model.config.vocab_size
    config = DrafterConfig(method=method, shape=LayerShape.of(target_model.config), vocab_size=vocab,
                           draft_vocab=draft_vocab, target={"name": "tiny", "probe": weight_probe(target_model)},
                           **options)
    ids = torch.randperm(vocab)[:draft_vocab].sort().values if draft_vocab else None
    network = (EagleHead if method == "eagle" else MTPHeads)(config, TargetParts.of(target_model), ids)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.normal_(0, 0.2)
    checkpoint.save(network, directory)
    return checkpoint.load(directory, method, target_model)


@pytest.mark.parametrize("layout, method, draft_vocab, options", [
    ("eagle", "eagle", 0, {}),
    ("eagle", "eagle", 40, {"layers": 2}),
    ("medusa", "mtp", 0, {"heads": 3}),
    ("medusa", "mtp", 40, {"heads": 2, "head_layers": 2}),
])
def test_an_exported_drafter_loads_back_and_drafts_the_same(target, tmp_path, layout, method, draft_vocab, options):
    model, _ = target
    original = trained(method, model, tmp_path / "exactspec", draft_vocab, **options)
    written = export(tmp_path / "exactspec", layout, tmp_path / layout, model)
    assert (tmp_path / layout / DRAFT_VOCAB_FILE in written) == bool(draft_vocab)
    config = json.loads((tmp_path / layout / "config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["exactspec_target"]["probe"]
    loaded = checkpoint.load(tmp_path / layout, method, model)  # the published layout: no drafter.json
    assert not (tmp_path / layout / checkpoint.CONFIG_FILE).exists()
    assert torch.equal(loaded.vocab.ids, original.vocab.ids)
    features = torch.randn(5, model.config.hidden_size)
    tokens = torch.randint(3, model.config.vocab_size, (5,))
    with torch.no_grad():
        if method == "eagle":
            same = original(features[None], tokens[None]), loaded(features[None], tokens[None])
        else:
            same = original(features), loaded(features)
    torch.testing.assert_close(*same, rtol=0, atol=0)  # the same drafts: the same logits over the same ids


def test_export_refusals_are_one_line(target, tmp_path, capsys):
    model, directory = target
    trained("mtp", model, tmp_path / "reading", token_input=True)
    trained("eagle", model, tmp_path / "eagle")
    cases = [
        (["--format", "medusa", "--drafter-path", str(tmp_path / "reading")], "--no-token-input"),
        (["--format", "medusa", "--drafter-path", str(tmp_path / "eagle")], "holds a eagle drafter"),
        (["--format", "eagle", "--drafter-path", str(tmp_path / "nowhere")], "not a drafter exactspec trained"),
        (["--format", "eagle"], "no trained eagle drafter ships"),
    ]
    for flags, message in cases:
        assert main(["export", str(tmp_path / "out"), "--model", str(directory), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert main(["export", str(tmp_path / "out"), "--model", str(directory), "--format", "eagle",
                 "--drafter-path", str(tmp_path / "eagle")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_shipped_eagle_exports_for_the_default_model_and_reads_back_the_same(tmp_path, capsys):
    from exactspec.drafters.loading import load_trained

    assert main(["export", str(tmp_path / "eagle"), "--format", "eagle"]) == 0, capsys.readouterr().err
    model = load_model(None, dtype="float32", backend="lean").model
    shipped, exported = load_trained("eagle", model), load_trained("eagle", model, tmp_path / "eagle")
    assert torch.equal(shipped.vocab.ids, exported.vocab.ids)
    features = torch.randn(1, 4, model.config.hidden_size)
    tokens = torch.randint(0, model.config.vocab_size, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(shipped(features, tokens), exported(features, tokens), rtol=0, atol=0)

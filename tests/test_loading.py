"""A draft model loads beside its target (loading.load_target), on a thread of its own. transformers' loading patches
its classes and puts them back (``PreTrainedModel.tie_weights`` among them), and quieting it redirects sys.stderr:
two loads at once put each other's patches back in the wrong order, and every tied model loaded after had its
output matrix left on the meta device. So they take turns (``logs.PROCESS_WIDE``)."""

from __future__ import annotations

import sys
import threading

import torch
from transformers import PreTrainedModel

from exactspec import models
from exactspec.loading import load_target
from tests.tiny import save_with_tokenizer, tiny_llama


def test_a_second_transformers_load_waits_for_the_first():
    holding, leave, second_in = threading.Event(), threading.Event(), threading.Event()

    def first():
        with models._quiet_transformers():
            holding.set()
            leave.wait(10)

    def second():
        holding.wait(10)
        with models._quiet_transformers():
            second_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    try:
        assert holding.wait(10)
        assert not second_in.wait(0.5), "the second load went in while the first held transformers' classes"
    finally:
        leave.set()
        for thread in threads:
            thread.join(10)
    assert second_in.is_set()


def test_a_tied_target_and_its_draft_load_side_by_side_and_leave_nothing_patched(tmp_path):
    model = tiny_llama(seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    path = save_with_tokenizer(model, tmp_path / "tied")
    tie_weights, stderr = PreTrainedModel.tie_weights, sys.stderr
    for _ in range(3):
        loaded = load_target(path, backend="lean", dtype="float32", device="cpu", draft_model=path,
                             drafters=("draft-model",))
        for side in (loaded.target, loaded.draft):
            head = side.model.get_output_embeddings().weight
            assert head.device.type == "cpu"
            assert torch.equal(head, side.model.get_input_embeddings().weight)
    assert PreTrainedModel.tie_weights is tie_weights
    assert sys.stderr is stderr

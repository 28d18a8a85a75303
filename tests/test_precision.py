"""Weight precisions: what a decode pass streams, the roofline's measurements, and how --dtype auto chooses."""

from __future__ import annotations

import pytest
from tiny import tiny_llama

from exactspec.backends import LeanRuntime, make_backend
from exactspec.backends.base import streamed_parameters
from exactspec.backends.lean import precision as auto
from exactspec.backends.linear import PassPrecisions
from exactspec.bench.roofline import measure_roofline


def test_a_decode_pass_streams_every_weight_but_the_input_embedding():
    untied = tiny_llama(seed=0)  # 64 x 32 embedding and a separate LM head
    total = sum(p.numel() for p in untied.parameters())
    assert streamed_parameters(untied) == total - 64 * 32
    tied = tiny_llama(seed=0)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert streamed_parameters(tied) == total - 64 * 32  # the shared matrix is read once, by the LM head
    assert LeanRuntime(untied, "float32").weight_bytes == 4 * streamed_parameters(untied)
    assert LeanRuntime(untied, PassPrecisions("float16", "float32")).weight_bytes == 2 * streamed_parameters(untied)


def test_roofline_measures_every_draft_length_and_leaves_the_cache_as_it_was():
    runtime = make_backend(tiny_llama(seed=0))
    context = list(range(3, 20))
    roofline = measure_roofline(runtime, context, max_k=4, repeats=2)
    assert list(roofline.score_ratios) == [1, 2, 3, 4]
    assert all(ratio > 0 for ratio in roofline.score_ratios.values())
    assert roofline.floor_seconds == pytest.approx(runtime.weight_bytes / roofline.bandwidth)
    assert roofline.bandwidth > 1e8  # any machine that runs the suite reads memory faster than 100 MB/s
    assert runtime.tokens == context


def measurement(precision: str, decode_ms: float, score_ms: float, bulk_ms: float, error: float
                ) -> auto.PrecisionMeasurement:
    return auto.PrecisionMeasurement(precision, decode_ms=decode_ms, score_ms=score_ms, bulk_ms=bulk_ms,
                                     max_logit_error=error)


def test_auto_takes_one_precision_the_fastest_admitted_at_decode_and_scoring():
    measured = [
        measurement("float32", decode_ms=80, score_ms=90, bulk_ms=100, error=0.0),
        measurement("float16", decode_ms=45, score_ms=95, bulk_ms=150, error=0.05),  # 140 ms against 170
        measurement("bfloat16", decode_ms=30, score_ms=60, bulk_ms=100, error=0.7),  # fastest, too far from float32
    ]
    assert not measured[2].admitted
    assert auto.choose(measured) == PassPrecisions.uniform("float16")  # bulk too: one precision for every pass
    assert auto.choose(measured[:1]) == PassPrecisions.uniform("float32")


def test_auto_measures_a_model_once_then_reads_its_choice_from_the_cache(monkeypatch):
    model = tiny_llama(seed=0)
    first = auto.auto_precisions(model)
    assert first.decode in ("float32", "float16", "bfloat16") and first.score in ("float32", "float16", "bfloat16")
    monkeypatch.setattr(auto, "measure", lambda *a, **k: pytest.fail("measured twice"))
    assert auto.auto_precisions(model) == first
    assert isinstance(make_backend(model, "auto"), LeanRuntime)


def test_measurement_compares_against_float32_on_the_same_probe():
    model = tiny_llama(seed=0, init_range=0.5)
    measured = {m.precision: m for m in auto.measure(model)}
    assert measured["float32"].max_logit_error == 0.0
    assert 0 < measured["float16"].max_logit_error < measured["bfloat16"].max_logit_error
    assert all(m.decode_ms > 0 and m.score_ms > 0 and m.bulk_ms > 0 for m in measured.values())

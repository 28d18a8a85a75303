"""``exactspec serve`` and ``exactspec bench-serve`` as a user runs them, on a tiny saved model."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_with_tokenizer, tiny_llama

from exactspec.bench.serve import Result, auto_ratios, sample_trace, table
from exactspec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_with_tokenizer(tiny_llama(seed=0, init_range=0.5), tmp_path_factory.mktemp("served") / "tiny")


@pytest.mark.parametrize("args, message", [
    (["--drafter", "medusa"], "invalid choice"),
    (["--drafter", "mtp"], "no trained mtp drafter ships for this target"),
    (["--drafter", "draft-model"], "no trained draft-model drafter ships for this target"),
    (["--drafter", "prompt-lookup", "--drafter-path", "/no/such/dir"], "--drafter-path is for trained drafters"),
    (["--tree", "0,2"], "tree widths must be between 1 and"),
    (["--tree", "wide"], "--tree takes candidates per depth"),
    (["--draft-model", "/no/such/draft"], "not found"),
    (["--datastore-capacity", "0", "--drafter", "retrieval"], "datastore-capacity"),
    (["--datastore-capacity", "-3"], "datastore-capacity"),
    (["--datastore-save"], "--datastore-save"),
    (["--speculation", "sometimes"], "invalid choice"),
    (["--port", "70000"], "port"),
    (["--max-batch-size", "0"], "max-batch-size"),
    (["--max-batch-size", "1000000000"], "which this machine cannot reserve: lower --max-batch-size"),
    (["--prefix-cache-tokens", "1000000000000"], "which this machine cannot reserve: lower --prefix-cache-tokens to"),
    (["--prefix-cache-mib", "1000000000000"], "which this machine cannot reserve: lower --prefix-cache-mib to"),
    (["--served-model-name", ""], "served-model-name must not be empty"),
    (["--served-model-name", "  "], "served-model-name must not be empty"),
    (["--served-model-name", "tiny", "a\x01b"], "holds a control character (U+0001)"),
    (["--served-model-name", "tiny\nx"], "holds a control character (U+000A)"),
    (["--served-model-name", "a\u202eb"], "holds a control character (U+202E)"),
    (["--served-model-name", " tiny"], "starts or ends with whitespace"),
    (["--num-draft-tokens", "0"], "num-draft-tokens"),
    (["--max-body-bytes", "10"], "max-body-bytes"),
    (["--max-header-line", "10"], "max-header-line"),
    (["--max-head-bytes", "10"], "max-head-bytes"),
    (["--datastore", "/no/such/store"], "datastore"),
    (["--model", "/no/such/model"], "not found"),
    (["--api-key-file", "/no/such/key"], "API key file"),
    (["--replicas", "-1"], "replicas"),
    (["--ray-address", "auto"], "--ray-address goes with --replicas"),
    (["--replicas", "2", "--request-timeout", "-1"], "request-timeout"),
    (["--replicas", "2", "--replica-routing", "random"], "--replica-routing"),
])
def test_bad_serve_settings_are_one_line_and_exit_2(model_dir, capsys, args, message):
    code = main(["serve", *(["--model", str(model_dir)] if "--model" not in args else []), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("exactspec: error:") and message in err, err


def test_serve_answers_then_drains_on_sigterm(model_dir, tmp_path):
    key = tmp_path / "key"
    key.write_text("sesame\n")
    process = subprocess.Popen([sys.executable, "-m", "exactspec.cli", "serve", "--model", str(model_dir),
                                "--port", "0", "--speculation", "always", "--api-key-file", str(key)],
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        assert "API key required" in line
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": "w3 w4 w3 w4", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        connection.request("POST", "/v1/completions", body)
        response = connection.getresponse()
        assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"
        connection.request("POST", "/v1/completions", body, {"Authorization": "Bearer sesame"})
        answer = json.loads(connection.getresponse().read())
        assert answer["usage"]["completion_tokens"] == 6 and answer["model"] == "tiny"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "shutting down" in process.stderr.read()
    finally:
        process.kill()


def sharegpt(path: Path, conversations: list[tuple[str, str]], cut: bool = False) -> Path:
    records = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
               for i, (q, a) in enumerate(conversations)]
    text = json.dumps(records)
    path.write_text(text[:-30] if cut else text)  # cut: as the packaged file is, mid-record
    return path


def test_trace_takes_first_turns_and_reply_lengths_and_drops_what_does_not_fit(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [("w3 w4 w5 w6", "w7 " * 10), ("w3", "w4 w5 w6 w7"), ("w3 " * 50, "w4 " * 8),
             ("w8 w9 w10 w11", "w3 " * 300),
             ("w5 w6 w7 w8 w9", "w10 w11 w12 w13"), ("w5 w6 w7 w8", "w9 w10 w11 w12 w13")]
    trace = sample_trace(sharegpt(tmp_path / "s.json", pairs, cut=True), tokenizer, count=3, seed=0,
                         max_prompt_tokens=20, max_output_tokens=32)
    assert sorted((r.prompt_tokens, r.output_tokens) for r in trace) == [(4, 10), (4, 32), (5, 4)]
    with pytest.raises(Exception, match="only 3 usable"):
        sample_trace(tmp_path / "s.json", tokenizer, count=4, seed=0, max_prompt_tokens=20, max_output_tokens=32)


def result(mode: str, concurrency: int, tokens_per_second: float) -> Result:
    return Result(mode, concurrency, requests=4, output_tokens=int(tokens_per_second * 10), seconds=10.0,
                  latency_median=1.0, latency_p99=2.0, speculative_steps=0.5, mean_accepted_length=1.2,
                  decode_seconds=5.0, prefill_seconds=5.0)


def test_auto_is_compared_with_the_better_of_always_and_never():
    results = [result("always", 1, 30), result("never", 1, 20), result("auto", 1, 29),
               result("always", 64, 100), result("never", 64, 200), result("auto", 64, 190)]
    ratios = auto_ratios(results)
    assert ratios == {1: pytest.approx(29 / 30), 64: pytest.approx(190 / 200)}
    assert "| 64 | auto | 4 | 190.0 | 380.0 | 50% |" in table(results)


@pytest.mark.slow  # over 10 s on 2 cores
def test_bench_serve_replays_a_trace_against_a_server_per_mode(model_dir, tmp_path, capsys):
    trace = sharegpt(tmp_path / "trace.json", [(f"w{3 + i} w4 w3 w4 w3", "w5 " * 6) for i in range(8)])
    out = tmp_path / "out"
    code = main(["bench-serve", "--model", str(model_dir), "--trace", str(trace), "--concurrency", "1,2",
                 "--min-requests", "2", "--max-output-tokens", "6", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench_serve.json").read_text())
    assert {(r["mode"], r["concurrency"]) for r in report["results"]} == {
        (m, c) for m in ("always", "never", "auto") for c in (1, 2)}
    assert all(r["output_tokens"] == r["requests"] * 6 for r in report["results"])
    assert all(r["decode_tokens_per_second"] > r["tokens_per_second"] > 0 for r in report["results"])
    assert set(report["auto_over_best"]) == {"1", "2"}
    assert (out / "bench_serve.png").stat().st_size > 0 and "| 2 | auto |" in (out / "bench_serve.md").read_text()
    never = [r for r in report["results"] if r["mode"] == "never"]
    assert all(r["speculative_steps"] == 0 and r["mean_accepted_length"] == 1 for r in never)


def test_a_busy_port_is_refused_in_one_line_before_the_model_loads(model_dir, capsys, monkeypatch):
    import socket

    from exactspec import loading

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was claimed")

    monkeypatch.setattr(loading, "load_target", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        code = main(["serve", "--model", str(model_dir), "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot listen on 127.0.0.1" in err and "in use" in err, err


def test_a_busy_port_is_refused_in_one_line_before_the_heavy_imports(model_dir):
    """``exactspec serve`` claims the port before it imports the server, PyTorch and the model (a busy port took 6.8 s
    to answer under load): refused in one line, exit 2, with none of them imported."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = ("import sys; from exactspec.cli import main; code = main(sys.argv[1:]); "
                  "heavy = sorted(m for m in ('torch', 'exactspec.server', 'fastapi') if m in sys.modules); "
                  "print(heavy); sys.exit(code)")
        run = subprocess.run([sys.executable, "-c", script, "serve", "--model", str(model_dir), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout.strip() == "[]", run
    assert run.stderr.strip() == f"exactspec: error: cannot listen on 127.0.0.1:{port}: Address already in use"

"""Only exactspec's voice on the terminal: llama.cpp's log lines go to Python logging (WARNING and above, everything
with --verbose), what a user must know is one ``exactspec:`` line, and ``--verbose`` shows the rest."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
from tiny import save_with_tokenizer, tiny_llama
from tiny_gguf import write_tiny_gguf

from exactspec.backends.llamacpp import LlamaCppLM

LONG_CONTEXT = 32768  # trained positions beyond the 8192 a single-sequence llama.cpp cache keeps
SHORT_CONTEXT_WARNING = "n_ctx_per_seq (8192) < n_ctx_train (32768)"  # llama.cpp's own warning about it


@pytest.fixture(scope="module")
def long_context_gguf(tmp_path_factory):  # Q8_0: its rows are the same in any pass, so no notice says otherwise
    return write_tiny_gguf(tmp_path_factory.mktemp("logs") / "long.gguf", context=LONG_CONTEXT, tensor_type="Q8_0")


def generate(model, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exactspec.cli", "generate", "hi", "--model", str(model),
                           "--max-new-tokens", "4", *flags], capture_output=True, text=True, timeout=300, check=False)


def is_summary(line: str) -> bool:
    """exactspec's summary line: the default drafter (the hybrid, with its sources' shares) with the default draft
    length (k auto), on some runtime."""
    return re.match(r"\[hybrid, k auto: mean draft [0-9.]+ on .* tokens per target pass; accepted tokens by source: "
                    r"prompt-lookup \d+%, retrieval \d+%$", line) is not None


def test_generate_on_a_gguf_says_only_exactspecs_lines(long_context_gguf):
    result = generate(long_context_gguf, "--backend", "llama.cpp")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "exactspec: long.gguf was trained on 32768 positions; prompt and answer together get 8192 here"
    assert len(lines) == 2 and is_summary(lines[1]), result.stderr


def test_verbose_shows_what_llama_cpp_says(long_context_gguf):
    result = generate(long_context_gguf, "--verbose", "--backend", "llama.cpp")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("llama.cpp: ") and SHORT_CONTEXT_WARNING in line for line in lines)
    assert sum(line.startswith("llama.cpp: llama_model_loader: ") for line in lines) > 10  # its INFO lines too
    assert is_summary(lines[-1])


def test_llama_cpp_warnings_reach_python_logging_and_its_info_does_not(long_context_gguf, caplog):
    with caplog.at_level(logging.DEBUG):
        LlamaCppLM.load(long_context_gguf)
    from_llama_cpp = [r for r in caplog.records if r.name == "llama.cpp"]
    assert any(r.levelno == logging.WARNING and SHORT_CONTEXT_WARNING in r.getMessage() for r in from_llama_cpp)
    assert all(r.levelno >= logging.WARNING for r in from_llama_cpp)  # the loader's INFO lines are dropped at source
    assert all("\n" not in r.getMessage() for r in from_llama_cpp)  # one record a line
    notices = [r.getMessage() for r in caplog.records if r.name == "exactspec.notice"]
    assert notices == ["long.gguf was trained on 32768 positions; prompt and answer together get 8192 here"]


def test_through_the_library_llama_cpp_says_nothing_unless_logging_is_configured(long_context_gguf):
    """The Python API with no logging configured: exactspec's notice reaches stderr, llama.cpp's warnings do not
    (Python's last-resort handler printed them); configured, they reach its handlers."""
    load = ("import logging, sys\nfrom exactspec.api import SpecDecoder\n"
            "if len(sys.argv) > 1: logging.basicConfig(level=logging.WARNING)\n"
            f"SpecDecoder.load(model={str(long_context_gguf)!r}, backend='llama.cpp')\n")
    quiet, configured = (subprocess.run([sys.executable, "-c", load, *flag], capture_output=True, text=True,
                                        timeout=300, check=False) for flag in ([], ["configured"]))
    assert quiet.returncode == configured.returncode == 0, quiet.stderr + configured.stderr
    assert quiet.stderr.splitlines() == [
        "long.gguf was trained on 32768 positions; prompt and answer together get 8192 here"], quiet.stderr
    assert any(line.startswith("WARNING:llama.cpp:") and SHORT_CONTEXT_WARNING in line
               for line in configured.stderr.splitlines()), configured.stderr


def test_auto_on_a_gguf_says_nothing_of_the_candidates_it_measured(tmp_path):
    """--backend auto loads llama.cpp, the fused runtime and the torch runtime to time them (converting the GGUF for
    transformers): none of what they say while measured reaches the terminal; the summary names the choice."""
    result = generate(write_tiny_gguf(tmp_path / "measured.gguf", context=512), "--threads", "1")
    assert result.returncode == 0, result.stderr
    *notices, summary = result.stderr.splitlines()
    assert is_summary(summary), result.stderr
    chosen = summary.split("]")[0].rsplit(" on ", 1)[1]
    # the one notice the chosen runtime may give of itself: llama.cpp's rows of F32 weights depend on the pass
    assert notices == [] or (chosen == "llama.cpp" and len(notices) == 1
                             and notices[0].startswith("exactspec: measured.gguf: llama.cpp")), result.stderr


def test_a_gguf_whose_rows_depend_on_the_pass_is_named_in_one_notice(tmp_path):
    """F32 weights: llama.cpp multiplies one row and several by different kernels."""
    result = generate(write_tiny_gguf(tmp_path / "f32.gguf", context=512), "--backend", "llama.cpp")
    assert result.returncode == 0, result.stderr
    notice, summary = result.stderr.splitlines()
    assert notice.startswith("exactspec: f32.gguf: llama.cpp (F32 weights, this build) computes a position's logits "
                             "differently alone and in a pass of several") and "exactspec quantize" in notice
    assert "--backend fused" in notice
    assert is_summary(summary)


def test_generate_on_a_transformers_directory_says_only_its_summary(tmp_path):
    """The torch runtime loads it through transformers, whose own warnings stay off the terminal."""
    model = save_with_tokenizer(tiny_llama(seed=0), tmp_path / "tiny")
    result = generate(model, "--backend", "lean")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and is_summary(lines[0]), result.stderr


@pytest.mark.slow
def test_generate_on_the_default_model_says_only_its_summary():
    result = subprocess.run([sys.executable, "-m", "exactspec.cli", "generate", "Write a haiku about the sea",
                             "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and is_summary(lines[0]), result.stderr


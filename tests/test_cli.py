"""The command line on tiny saved models: JSON output, streaming, and one-line errors for bad input."""

from __future__ import annotations

import html
import io
import json
import re
import subprocess
import sys

import pytest
from tiny import perturbed_copy, save_with_tokenizer, tiny_llama

from exactspec.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(seed=0, init_range=0.5)
    other_words = ["<s>", "</s>", "<unk>"] + [f"v{i}" for i in range(3, 64)]
    return {
        "target": save_with_tokenizer(target, root / "target"),
        "draft": save_with_tokenizer(perturbed_copy(target, noise=0.03, seed=1), root / "draft"),
        "other_vocab": save_with_tokenizer(tiny_llama(seed=2), root / "other", words=other_words),
        "uncovered": save_with_tokenizer(tiny_llama(seed=0, hidden=48), root / "uncovered"),  # heads of 12
    }


PROMPT = "w5 w9 w12 w9 w12 w40"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "draft-model"])
def test_json_output(models, capsys, drafter):
    code, out, err = run_cli(
        capsys, "generate", PROMPT, "--model", str(models["target"]), "--draft-model", str(models["draft"]),
        "--drafter", drafter, "--max-new-tokens", "12", "--json", "--no-chat",
    )
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["finish_reason"] in ("stop", "length")
    assert set(result["stats"]) >= {"rounds", "draft_tokens", "accepted_tokens", "acceptance_rate",
                                    "mean_accepted_length", "new_tokens", "seconds", "tokens_per_second"}
    assert len(result["token_ids"]) == result["stats"]["new_tokens"] <= 12
    assert result["stats"]["mean_accepted_length"] == pytest.approx(
        result["stats"]["new_tokens"] / result["stats"]["rounds"])
    if drafter == "none":
        assert result["stats"]["draft_tokens"] == 0


def test_all_drafters_give_the_same_greedy_text(models, capsys):
    """Greedy output is the same with every drafter, bit for bit."""
    texts = set()
    for drafter in ["none", "prompt-lookup", "draft-model"]:
        code, out, _ = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--draft-model",
                               str(models["draft"]), "--drafter", drafter, "--max-new-tokens", "20", "--json",
                               "--dtype", "float32")
        texts.add(json.loads(out)["text"])
    assert len(texts) == 1


def test_streams_text_then_a_summary_line(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--max-new-tokens", "8",
                             "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert code == 0
    assert out.strip()
    summary = err.strip().splitlines()[-1]
    for words in ("new tokens", "tokens/s", "acceptance rate", "mean accepted length"):
        assert words in summary
    assert " on fused]" in summary or " on lean]" in summary  # the backend --backend auto measured fastest


def test_the_fused_runtime_named_for_a_model_it_does_not_cover_is_one_line_and_exit_2(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["uncovered"]), "--backend", "fused")
    assert code == 2 and err.count("\n") == 1 and "--backend fused cannot run uncovered" in err, err
    assert "multiples of 8" in err


def test_auto_passes_the_fused_runtime_by_for_a_model_it_does_not_cover_and_says_why(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["uncovered"]), "--max-new-tokens", "4")
    assert code == 0 and "passes exactspec's fused runtime by" in err and "multiples of 8" in err, err
    assert err.strip().splitlines()[-1].startswith("[hybrid, k auto: mean draft ")
    assert " on lean]" in err.strip().splitlines()[-1]


def test_the_lean_runtime_answers_to_its_old_name_torch(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--backend", "torch",
                             "--max-new-tokens", "4", "-k", "4")
    assert code == 0 and err.strip().splitlines()[-1].startswith("[hybrid on lean]"), err


def test_explicit_fused_runs_and_names_itself(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--backend", "fused",
                             "--max-new-tokens", "6", "-k", "3")
    assert code == 0 and err.strip().splitlines()[-1].startswith("[hybrid on fused]"), err


def test_the_draft_length_is_auto_unless_k_is_named(models, capsys):
    """By default each round drafts the length that maximises expected tokens per second (0 where speculation does
    not pay), so the default speculation is never much slower than none; a named k is kept."""
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--max-new-tokens", "6")
    assert code == 0 and err.strip().splitlines()[-1].startswith("[hybrid, k auto: mean draft "), err


def test_seed_makes_sampling_repeatable(models, capsys):
    args = ["generate", PROMPT, "--model", str(models["target"]), "--draft-model", str(models["draft"]),
            "--max-new-tokens", "16", "--temperature", "1", "--seed", "7", "--json"]
    first = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    second = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    assert first == second


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "   "], "prompt is empty"),
        (["generate", PROMPT, "-k", "0"], "num-draft-tokens"),
        (["generate", PROMPT, "-k", "65"], "num-draft-tokens"),
        (["generate", PROMPT, "--temperature", "-1"], "temperature"),
        (["generate", PROMPT, "--temperature", "inf"], "finite"),
        (["generate", PROMPT, "--temperature", "nan"], "temperature"),
        (["generate", PROMPT, "--temperature", "1", "--seed", str(2**64)], "64-bit"),
        (["generate", PROMPT, "--top-p", "0"], "top-p"),
        (["generate", PROMPT, "--top-p", "1.01"], "top-p"),
        (["generate", PROMPT, "--top-k", "-3"], "top-k"),
        (["generate", PROMPT, "--max-new-tokens", "0"], "max-new-tokens"),
        (["generate", PROMPT, "--model", "/no/such/model"], "not found"),
        (["generate", PROMPT, "--draft-model", "/no/such/draft"], "not found"),
        (["generate", PROMPT, "--drafter", "draft-model"], "no trained draft-model drafter ships for this target"),
        (["generate", PROMPT, "--drafter", "nonsense"], "invalid choice"),
        (["generate", PROMPT, "--temperature", "warm"], "invalid float"),
        (["generate", PROMPT, "--temperature", "1", "--sampling", "gumbel"], "argument --sampling: invalid choice"),
        (["generate", PROMPT, "--tree", "3,x"], "--tree takes candidates per depth"),
        (["generate", PROMPT, "--tree", "3,0"], "tree widths must be between 1 and 16"),
        (["generate", PROMPT, "--tree", "3", "--drafter", "none"], "drafts chains only, not trees"),
        (["generate", PROMPT, "--backend", "fused", "--dtype", "float32"],
         "--backend fused runs int8 or float16 weights"),
        (["generate", PROMPT, "--backend", "fused", "--device", "cuda"], "runs on the CPU here"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(models, capsys, args, message):
    code, out, err = run_cli(capsys, *args, *(["--model", str(models["target"])] if "--model" not in args
                                              and args[0] == "generate" else []))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("exactspec: error:") and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argument, stdin", [("-", b"caf\xe9 w5 w9\n"), ("caf\udce9 w5 w9\n", b"")])
def test_a_prompt_that_is_not_utf8_is_read_with_replacement(models, capsys, monkeypatch, argument, stdin):
    """Issue 33: ``printf 'caf\\xe9' | exactspec generate -`` handed the tokenizer a lone surrogate (standard input read
    with surrogateescape, as Python reads an argument's bytes) and printed a traceback. A byte that is not UTF-8 is
    U+FFFD: the same answer as the prompt written with it."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors="surrogateescape"))
    flags = ("--model", str(models["target"]), "--max-new-tokens", "4", "--json", "--no-chat")
    code, out, err = run_cli(capsys, "generate", argument, *flags)
    assert code == 0 and "Traceback" not in err, err
    replaced = run_cli(capsys, "generate", "caf\ufffd w5 w9\n", *flags)
    assert replaced[0] == 0 and json.loads(out)["token_ids"] == json.loads(replaced[1])["token_ids"]


def closed_stream() -> io.TextIOWrapper:
    stream = io.TextIOWrapper(io.BytesIO(b"w5"))
    stream.close()
    return stream


@pytest.mark.parametrize("stdin, message", [(None, "there is no standard input"),
                                            (closed_stream(), "cannot read the prompt from standard input")])
def test_standard_input_that_cannot_be_read_is_one_line_and_exit_2(models, capsys, monkeypatch, stdin, message):
    """Closed before the run (Python's sys.stdin is then None), or a stream that refuses to be read."""
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = run_cli(capsys, "generate", "-", "--model", str(models["target"]))
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("method", ["text", "intersection"])
def test_a_draft_model_with_another_vocabulary_drafts_and_changes_no_token(models, capsys, method):
    """Another vocabulary (transformers tokenizers of other words) is bridged, not refused: plain decoding's text."""
    texts = []
    for extra in ((), ("--draft-model", str(models["other_vocab"]), "--cross-vocabulary", method)):
        code, out, _ = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--max-new-tokens",
                               "12", "--json", "--no-chat", "-k", "3", *extra)
        assert code == 0
        texts.append(json.loads(out)["token_ids"])
    assert texts[0] == texts[1]


def test_the_installed_command_exits_2_without_traceback(tmp_path):
    """The console script itself, as a user runs it: a missing model path."""
    proc = subprocess.run([sys.executable, "-m", "exactspec.cli", "generate", "hi", "--model", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_token_view_in_terminal_and_html(models, capsys, tmp_path):
    page = tmp_path / "view.html"
    code, out, err = run_cli(capsys, "generate", "w5 w9 w12 w9 w12 w9 w12 w9", "--model", str(models["target"]),
                             "--draft-model", str(models["draft"]), "--max-new-tokens", "16", "--show-acceptance",
                             "--html", str(page), "-k", "4")  # a fixed k drafts every round
    assert code == 0 and "\x1b[32m" in out  # accepted draft tokens, in green
    assert "accepted draft token" in err  # the legend
    page_text = page.read_text()
    assert page_text.startswith("<!DOCTYPE html>") and 'class="accepted"' in page_text
    plain_text = json.loads(run_cli(capsys, "generate", "w5 w9 w12 w9 w12 w9 w12 w9", "--model",
                                    str(models["target"]), "--draft-model", str(models["draft"]),
                                    "--max-new-tokens", "16", "--json")[1])["text"]
    shown = "".join(re.findall(r'title="\w+">([^<]*)</span>', page_text))
    assert html.unescape(shown) == plain_text


def test_an_adaptive_draft_length_reports_its_choices(models, capsys):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--drafter", "retrieval",
                             "-k", "auto", "--max-new-tokens", "16", "--json", "--no-chat", "--dtype", "float32")
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["policy"] == "auto"
    assert sum(stats["chosen_k"].values()) == stats["rounds"]
    assert all(0 <= int(k) <= 16 for k in stats["chosen_k"])


def test_help_and_refused_values_do_not_import_torch():
    """exactspec --help, and a command refused for a bad value, answer before torch or transformers is imported."""
    script = ("import sys, contextlib, io\n"
              "from exactspec.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
              "    codes = [main(args) for args in (['generate', 'hi', '-k', '0'],\n"
              "                                     ['generate', 'hi', '--top-p', '2'],\n"
              "             ['serve', '--speculation', 'sometimes'], ['train', '--method', 'x', '--out', 'o'])]\n"
              "    try:\n"
              "        main(['--help'])\n"
              "    except SystemExit:\n"
              "        pass\n"
              "print(codes, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["[2,", "2,", "2,", "2]", "False", "False"], result.stdout + result.stderr


def test_without_the_extension_auto_says_why_once_and_fused_is_refused(models, capsys, monkeypatch):
    """A failed build at install (or a CPU without AVX2/FMA/F16C): --backend auto runs without the fused runtime
    and says why once, when it measures; --backend fused is one line and exit 2."""
    from exactspec.backends import native

    reason = "its C extension was not built at install (reinstall with a C compiler: pip install -e . prints why)"
    monkeypatch.setattr(native, "library", lambda: reason)
    args = ["generate", PROMPT, "--model", str(models["draft"]), "--max-new-tokens", "4", "-k", "4"]
    first = run_cli(capsys, *args)
    assert first[0] == 0 and f"passes exactspec's fused runtime by: {reason}" in first[2], first[2]
    assert first[2].strip().splitlines()[-1].startswith("[hybrid on lean]")
    from exactspec import runtime_choice as choice

    choice._passed_by.cache_clear()  # a new process: the choice comes from the cache, and is not said again
    second = run_cli(capsys, *args)
    assert second[0] == 0 and "passes exactspec's fused runtime by" not in second[2], second[2]
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(models["target"]), "--backend", "fused")
    assert code == 2 and err.count("\n") == 1 and reason in err, err

"""The names and limits the command line offers, in a module that imports nothing, so that ``exactspec --help`` and
a refused flag answer without loading torch. The modules that implement each choice import their names from here.
"""

import math
from pathlib import Path

from exactspec.errors import UsageError

BUILT_IN_DRAFTERS = ("hybrid", "none", "prompt-lookup", "retrieval", "draft-model", "mtp", "eagle", "early-exit")


def _drafter_files() -> tuple[str, ...]:
    """Every drafter module in exactspec/proposers/ (all but base.py), as --drafter names it: ngram.py is ngram,
    prompt_lookup.py prompt-lookup. Read from the file names, so that --help imports nothing."""
    folder = Path(__file__).parent / "proposers"
    return tuple(path.stem.replace("_", "-") for path in folder.glob("*.py") if path.stem not in ("__init__", "base"))


# --drafter: the built-in drafters in the order the help lists them, then any other drafter module, by name
DRAFTERS = BUILT_IN_DRAFTERS + tuple(sorted(set(_drafter_files()) - set(BUILT_IN_DRAFTERS)))
TRAINED_METHODS = ("draft-model", "mtp", "eagle", "early-exit")  # exactspec train --method: drafters it makes
# --cross-vocabulary: how a draft model with another tokenizer proposes (proposers/draft_model.py)
CROSS_VOCABULARY_METHODS = ("auto", "text", "intersection")
# what a draft model drafts with (backends/fused/draft_grade.py): auto, its draft-grade copy (a draft vocabulary, 4-bit
# matrices) where its runtime makes one; vocabulary, the draft vocabulary alone (the stored bits); off, the model as is
DRAFT_GRADES = ("auto", "vocabulary", "off")
SPECULATION_MODES = ("auto", "always", "never")  # exactspec serve --speculation
REPLICA_ROUTINGS = ("prefix", "ray")  # exactspec serve --replica-routing: by the prompt's prefix, or Ray's spreading
# --backend: auto, and the runtimes the wings declare (backends.kinds; tests/test_runtime_kinds.py holds them equal)
BACKENDS = ("auto", "lean", "fused", "llama.cpp")
BACKEND_ALIASES = {"torch": "lean"}  # --backend values kept for scripts: the lean runtime's old name
MAX_DRAFT_TOKENS = 64  # --num-draft-tokens
EXPORT_FORMATS = {"eagle": "eagle", "medusa": "mtp"}  # exactspec export --format: published layout -> drafter method
POLICY_NAMES = ("auto", "heuristic")  # --num-draft-tokens that adapt: the cost model, transformers' schedule
MAX_TREE_WIDTH = 16  # --tree: candidates at one depth
MAX_STOP_STRINGS = 4  # stop: strings that end a text (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # logprobs: the most likely tokens given beside each token (OpenAI's bound)
SAMPLING_METHODS = ("invariant", "standard")  # --sampling: Gumbel-max under shared noise, or min(1, p/q)
DEFAULT_SAMPLING_METHOD = "invariant"
QUANTIZE_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # exactspec quantize --type: rows pass-invariant where measured
SEED_RANGE = (-(1 << 63), 1 << 64)  # what a 64-bit generator takes: signed or unsigned 64-bit integers


# --- the checks of those flags' values (the classes that hold the values call them too) ------------------------------


def canonical_backend(text: str) -> str:
    """A ``--backend`` value under its runtime's name: an old name (``BACKEND_ALIASES``) becomes the new one."""
    return BACKEND_ALIASES.get(text, text)


def parse_num_draft_tokens(text: str | int) -> int | str:
    """``--num-draft-tokens``: an integer k, or the name of an adaptive policy ("auto", "heuristic")."""
    try:
        value = int(text)
    except ValueError:
        value = text
    check_num_draft_tokens(value)
    return value


def check_num_draft_tokens(value: int | str) -> None:
    if isinstance(value, str):
        if value not in POLICY_NAMES:
            raise UsageError(f"num-draft-tokens must be an integer or one of {', '.join(POLICY_NAMES)}, got {value!r}")
    elif not 1 <= value <= MAX_DRAFT_TOKENS:
        raise UsageError(f"num-draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {value}")


def parse_tree(text: str | None) -> tuple[int, ...] | str | None:
    """``--tree``: candidates at each depth, joined by ``,`` or ``/`` (``3,2,1``; the last repeats deeper), or
    ``auto`` (the cost model chooses each round's shape); None: a chain."""
    if text is None or text == "auto":
        return text
    try:
        widths = tuple(int(part) for part in text.replace("/", ",").split(","))
    except ValueError:
        raise UsageError(f"--tree takes candidates per depth, such as 3,2,1, or auto; got {text!r}") from None
    check_tree(widths)
    return widths


def check_tree(tree: tuple[int, ...] | str | None) -> None:
    if isinstance(tree, str) and tree != "auto":
        raise UsageError(f"a tree is candidates per depth or auto, got {tree!r}")
    if isinstance(tree, tuple) and not (tree and all(1 <= w <= MAX_TREE_WIDTH for w in tree)):
        raise UsageError(f"tree widths must be between 1 and {MAX_TREE_WIDTH}, got {tree}")


def check_logprobs(value: int | None) -> None:
    """None (no log-probabilities) or how many of the most likely tokens to give beside each token's own."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise UsageError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")


def check_max_new_tokens(value: int) -> None:
    if value < 1:
        raise UsageError(f"max-new-tokens must be >= 1, got {value}")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not 0 <= temperature < math.inf:  # also rejects NaN
        raise UsageError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise UsageError(f"top-k must be >= 0, got {top_k}")
    if not 0 < top_p <= 1:
        raise UsageError(f"top-p must be in (0, 1], got {top_p}")


def check_sampling_method(method: str) -> None:
    if method not in SAMPLING_METHODS:
        raise UsageError(f"sampling must be one of {', '.join(SAMPLING_METHODS)}, got {method!r}")


def check_seed(seed: int | None) -> None:
    """Refuse a seed that a 64-bit generator cannot take."""
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise UsageError(f"seed must be a 64-bit integer, in [-2^63, 2^64), got {seed}")


DEFAULT_DRAFTER = "hybrid"  # --drafter left out: every source it has (copies, and a draft model given or found)
DATASTORE_DRAFTERS = ("retrieval", "hybrid")  # the drafters that copy from a datastore (their ROLE says so too)


def check_datastore_drafter(drafter: str, datastore_given: bool) -> None:
    """A datastore is what the retrieval drafter (and the hybrid, through it) copies from; no other drafter reads
    one."""
    if datastore_given and drafter not in DATASTORE_DRAFTERS:
        raise UsageError(f"a datastore drafts only with --drafter {' or '.join(DATASTORE_DRAFTERS)}, not {drafter}")

"""The contributor's templates (tests/templates/, docs/architecture.md) stay true to the house: each, with its names
filled in, is Python that loads, and the drafter template is a drafter the house's checks take. Every drafter
module in exactspec/proposers/ is offered by --drafter and built by its own ``make``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
from drafter_checks import check_drafts

from exactspec.choices import DRAFTERS
from exactspec.proposers import DRAFTER_MODULES, PROPOSERS

TEMPLATES = Path(__file__).parent / "templates"


def rendered(name: str) -> str:
    return (TEMPLATES / name).read_text().replace("ClassName", "TemplateCheck").replace("NAME", "template_check")


def test_every_template_is_python_once_named():
    for template in TEMPLATES.rglob("*.tmpl"):
        ast.parse(rendered(str(template.relative_to(TEMPLATES))), filename=str(template))


def test_the_drafter_template_is_a_drafter(tmp_path):
    path = tmp_path / "template_check.py"
    path.write_text(rendered("drafter.py.tmpl"))
    spec = importlib.util.spec_from_file_location("template_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    proposer = module.make(None, None, None)
    assert proposer.name == "template_check"
    check_drafts(proposer, vocab_size=64)
    proposer.clear_cache()


def test_every_drafter_module_is_offered_and_made_by_its_own_make():
    files = {path.stem.replace("_", "-") for path in (Path(DRAFTER_MODULES["none"].__file__).parent).glob("*.py")}
    assert set(DRAFTERS) == files - {"--init--", "base"} and "ngram" in DRAFTERS
    for name, module in DRAFTER_MODULES.items():
        assert PROPOSERS[name] is module.make


@pytest.fixture
def template_wing(tmp_path, monkeypatch):
    """The runtime template with its names filled in, as a wing beside the others (a folder on exactspec/backends/'s
    search path): what copying it to exactspec/backends/template_check/ makes, and nothing else edited."""
    from exactspec import backends

    wing = tmp_path / "wings" / "template_check"
    wing.mkdir(parents=True)
    (wing / "__init__.py").write_text(rendered("runtime/__init__.py.tmpl"))
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(wing.parent)])
    yield importlib.import_module("exactspec.backends.template_check")
    sys.modules.pop("exactspec.backends.template_check", None)


def test_a_runtime_made_from_the_template_registers_itself_and_loads(template_wing, tmp_path):
    """The recipe's promise: the wing's KIND is all the loading layer needs. It loads a target by its name, builds
    its runtime, is refused for a drafter that needs what it does not declare, and --backend auto leaves it alone
    until it asks to be measured."""
    from tiny import save_with_tokenizer, tiny_llama

    from exactspec.backends import kind, runtime_of
    from exactspec.errors import UsageError
    from exactspec.loading import load_target
    from exactspec.runtime_choice import candidates

    assert kind("template_check") is template_wing.KIND
    directory = save_with_tokenizer(tiny_llama(seed=0), tmp_path / "tiny")
    loaded = load_target(str(directory), backend="template_check", drafters=("prompt-lookup",))
    assert loaded.target.backend == "template_check"
    assert isinstance(runtime_of(loaded.target), template_wing.TemplateCheckRuntime)
    with pytest.raises(UsageError, match="--drafter eagle needs a FeatureSource, which template_check's runtime"):
        load_target(str(directory), backend="template_check", drafters=("eagle",))
    assert template_wing.KIND not in candidates(gguf=False)[0]

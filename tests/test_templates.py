"""The contributor's templates (tests/templates/, docs/architecture.md) stay true to the house: each, with its names
filled in, is Python that loads, and the drafter template is a drafter the house's checks take. Every drafter
module in specdec/proposers/ is offered by --drafter and built by its own ``make``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from drafter_checks import check_drafts

from specdec.choices import DRAFTERS
from specdec.proposers import DRAFTER_MODULES, PROPOSERS

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

"""What runtimes and drafters declare of themselves is what the loading layer does with them: a runtime's KIND (its
name, what it refuses) and a drafter's ROLE (a draft model, a datastore, trained weights, a capability of the
target's backend), asked by name nowhere else."""

from __future__ import annotations

import pytest
from tiny import save_with_tokenizer, tiny_llama

from exactspec.api import SpecDecoder
from exactspec.backends import kind, kinds, runtime_of
from exactspec.choices import (
    BACKEND_ALIASES,
    BACKENDS,
    DEFAULT_DRAFTER,
    DRAFTERS,
    TRAINED_METHODS,
    check_datastore_drafter,
)
from exactspec.cli import main
from exactspec.drafters.networks import NETWORKS
from exactspec.errors import UsageError
from exactspec.loading import check_backend_serves, draft_source
from exactspec.models import check_backend, load_model
from exactspec.proposers import DRAFTER_MODULES, drafters_where, role


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny llama target loaded on the default runtime (its tokenizer too: a draft model of the same vocabulary)."""
    directory = save_with_tokenizer(tiny_llama(seed=0), tmp_path_factory.mktemp("kinds") / "tiny")
    return load_model(str(directory), dtype="float32", device="cpu")


def test_an_unknown_backend_is_one_line_naming_those_known(capsys):
    known = ", ".join(["auto"] + [k.name for k in kinds()])
    for refuse in (lambda: kind("nope"), lambda: SpecDecoder.load(backend="nope")):
        with pytest.raises(UsageError) as refused:
            refuse()
        assert str(refused.value) == f"unknown backend 'nope'; choose from {known}"
    assert main(["generate", "hi", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--backend" in err and "invalid choice" in err, err


def test_the_command_line_offers_every_declared_runtime():
    """choices.BACKENDS imports nothing (--help loads no wing): it is held equal to the wings' declarations."""
    names = [k.name for k in kinds()]
    assert sorted(BACKENDS) == sorted(["auto", *names]) and len(set(names)) == len(names)
    assert set(BACKEND_ALIASES.values()) <= set(names)


def test_each_runtime_refuses_what_it_declares(tmp_path):
    """A runtime of a GGUF alone refuses a transformers directory; one with weights of its own refuses --dtype and a
    device other than the CPU, naming the runtimes that take them; any runtime takes what it declares it takes."""
    directory, gguf = tmp_path / "model", tmp_path / "model.gguf"
    for declared in kinds():
        if declared.gguf_only:
            with pytest.raises(UsageError, match="runs a .gguf file") as refused:
                check_backend(declared.name, directory, "auto", "auto")
            assert all(k.name in str(refused.value) for k in kinds() if not k.gguf_only)
        if declared.weights is not None:
            with pytest.raises(UsageError, match="runs on the CPU here, not on cuda"):
                check_backend(declared.name, gguf, "auto", "cuda")
            with pytest.raises(UsageError, match="--dtype float16 is for --backend") as refused:
                check_backend(declared.name, gguf, "float16", "auto")
            assert declared.weights in str(refused.value)
        elif declared.unavailable() is None:
            assert check_backend(declared.name, gguf, "float16", "cpu") is declared


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_drafters_declared_role_is_what_loading_does_with_it(name, tiny_target, tmp_path):
    declared = role(name)
    assert declared.needs is getattr(DRAFTER_MODULES[name], "NEEDS", None)
    for runtime in kinds():  # the capability it needs, refused before anything loads where a runtime lacks it
        if declared.needs is None or declared.needs in runtime.runtime.__mro__:
            check_backend_serves(name, runtime.name)
        else:
            with pytest.raises(UsageError, match=f"--drafter {name} needs a {declared.needs.__name__}"):
                check_backend_serves(name, runtime.name)
    if declared.reads_datastore:
        check_datastore_drafter(name, datastore_given=True)
    else:
        with pytest.raises(UsageError, match="a datastore drafts only with"):
            check_datastore_drafter(name, datastore_given=True)
    backend = runtime_of(tiny_target)
    if declared.trained:  # its weights: the ones shipped for the target (none for this one), or --drafter-path
        with pytest.raises(UsageError, match=f"no trained {name} drafter ships for this target"):
            draft_source(name, tiny_target, backend, None, None)
    elif declared.takes_heads:  # a trained head's path: a directory with no drafter in it is refused in one line
        with pytest.raises(UsageError, match=f"--drafter-path {tmp_path}: no readable"):
            draft_source(name, tiny_target, backend, None, None, drafter_path=tmp_path)
    else:
        with pytest.raises(UsageError, match="--drafter-path is for trained drafters"):
            draft_source(name, tiny_target, backend, None, None, drafter_path=tmp_path)
    if declared.needs_draft_model:  # a draft model given drafts, on its own runtime
        assert type(draft_source(name, tiny_target, backend, tiny_target, None)) is type(backend)
    elif declared.takes_draft_model:  # beside the copies: the hybrid's sources hold it
        assert type(draft_source(name, tiny_target, backend, tiny_target, None).model) is type(backend)
    elif not declared.trained:  # a drafter that copies drafts with nothing loaded
        assert draft_source(name, tiny_target, backend, tiny_target, None) is None


def test_the_declared_roles_are_the_lists_the_command_line_and_the_drafter_files_offer():
    """exactspec train --method offers the trained drafters, and a drafter.json names one of their networks; the
    drafter left out is the one of what was given."""
    trained = drafters_where(lambda r: r.trained)
    assert set(trained) == set(TRAINED_METHODS) == set(NETWORKS)
    default = role(DEFAULT_DRAFTER)  # the hybrid: copies, a datastore where given, a draft model where given or found
    assert default.takes_draft_model and default.reads_datastore
    assert not (default.needs_draft_model or default.trained or default.needs)
    with pytest.raises(UsageError, match="unknown drafter 'nope'; choose from"):
        role("nope")

import pytest


@pytest.fixture(autouse=True)
def private_precision_cache(tmp_path, monkeypatch):
    """``--dtype auto`` keeps its measurements in the user's cache; tests keep theirs apart."""
    from exactspec.backends.lean import precision

    monkeypatch.setattr(precision.CACHE, "path", lambda: tmp_path / "precisions.json")


@pytest.fixture(scope="session")
def backend_cache_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("backend-choice")


@pytest.fixture(autouse=True)
def private_backend_cache(backend_cache_directory, monkeypatch):
    """``--backend auto`` keeps its measurements in the user's cache; tests keep theirs apart, in one place for the
    whole session (a model is measured once)."""
    from exactspec import runtime_choice as choice

    monkeypatch.setattr(choice.CACHE, "path", lambda: backend_cache_directory / "backends.json")


@pytest.fixture(autouse=True)
def command_line_logging_undone(monkeypatch):
    """``exactspec.cli.main`` run in this process configures logging for a terminal (:func:`exactspec.logs.configure`);
    each test starts from the library's state again."""
    import logging
    import os

    from exactspec import logs

    names = (logs.LLAMA_CPP.name, logs.NOTICES.name)
    saved = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate,
                    list(logging.getLogger(name).handlers)) for name in names}
    root_handlers = list(logging.getLogger().handlers)
    transformers_verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    monkeypatch.setattr(logs, "_verbose", logs._verbose)
    yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers
    logging.getLogger().handlers[:] = root_handlers
    os.environ.pop("TRANSFORMERS_VERBOSITY", None)
    if transformers_verbosity is not None:
        os.environ["TRANSFORMERS_VERBOSITY"] = transformers_verbosity

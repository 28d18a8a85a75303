import pytest


@pytest.fixture(autouse=True)
def private_precision_cache(tmp_path, monkeypatch):
    """``--dtype auto`` keeps its measurements in the user's cache; tests keep theirs apart."""
    from specdec.backends import precision

    monkeypatch.setattr(precision, "_cache_path", lambda: tmp_path / "precisions.json")

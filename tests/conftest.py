# Import dflash_mlx before anything imports mlx.core, so its BLAS routing applies.
import os
from pathlib import Path

import dflash_mlx  # noqa: F401
import pytest


def pytest_collection_modifyitems(config, items):
    """Tests that load a real model first: under pytest-xdist (`--dist worksteal`) the long
    ones then start at once and the short ones fill the other workers around them."""
    # The two-rank launch (tests/test_distributed.py's `ranks`) goes first of all: its tests then
    # share one worker (work stealing takes from the tail), which launches once, and no other
    # worker waits on its lock.
    items.sort(key=lambda item: ("ranks" not in getattr(item, "fixturenames", ()),
                                 item.get_closest_marker("slow") is None))  # stable: file order otherwise


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """Caches the tests make (converted GGUF tokenizers of the tiny models written in every run)
    go under the session's temp folder, never the user's ~/.cache; a test that wants the real
    cache removes the variable itself (monkeypatch, put back after it)."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg-cache")
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


def shared_folder(tmp_path_factory) -> Path:
    """One folder per test session, the same in every pytest-xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


LAUNCH_RUNNING = "distributed-launch-running"


@pytest.fixture(autouse=True)
def _yield_to_the_two_rank_launch(tmp_path_factory):
    """While tests/test_distributed.py's two-rank launch runs, other workers start no test: its
    ranks poll their sockets while they wait on each other, so a rank that shares its core with a
    test stalls the other one too (the launch took 111 s beside the suite, 24-28 s alone)."""
    import time

    flag = shared_folder(tmp_path_factory) / LAUNCH_RUNNING
    deadline = time.monotonic() + 600
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield


@pytest.fixture
def always_copy(monkeypatch):
    """Copies decided by the match alone, not by measured cycle times: every cycle that has a match
    verifies as much of it as the budget allows, as a chain (copy trees: tests/test_copy_trees.py)."""
    from dflash_mlx.policy.copies import CopyPolicy
    from dflash_mlx.policy.copy_trees import CopyTreePolicy

    monkeypatch.setattr(CopyPolicy, "choose", lambda self, match, remaining, draft_width:
                        0 if match is None else max(0, min(self.max_length, remaining - 1)))
    monkeypatch.setattr(CopyTreePolicy, "plan", lambda self, *args: None)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default target, loaded once per test process: (model, tokenizer), the same
    objects as `gguf_helpers.load_packaged("smollm2-135m")`. Tests must not change them."""
    from gguf_helpers import load_packaged

    return load_packaged("smollm2-135m")


@pytest.fixture(scope="session")
def verifier():
    """The tiny verifier (target) of the speculators fixtures, as mlx-lm loads it, float32."""
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(__file__).parent / "fixtures" / "speculators" / "verifier")
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model

import atexit
import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

import embedcore as ec

# torch.compile's on-disk caches (TorchInductor's FX graph and AOTAutograd
# caches) key a graph by its code, not by what its custom ops do: a cache
# left by another embedcore version would run that version's compiled code.
# The tests compile into their own directory, removed at exit.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="embedcore-test-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name, so every test is reproducible
    (EMBEDCORE_TEST_SEED=<text> draws other, equally reproducible, seeds)."""
    seed = zlib.crc32((request.node.nodeid + os.environ.get("EMBEDCORE_TEST_SEED", "")).encode())
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def restore_threads():
    """Restores the engine's thread count after every test, so that a test
    that changes it leaves the tests after it (on its xdist worker) the
    count they were written for."""
    before = ec.get_num_threads()
    yield before
    ec.set_num_threads(before)
    assert ec.get_num_threads() == before

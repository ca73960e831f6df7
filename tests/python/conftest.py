import os
import zlib

import numpy as np
import pytest

import embedcore as ec


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name, so every test is reproducible
    (EMBEDCORE_TEST_SEED=<text> draws other, equally reproducible, seeds)."""
    seed = zlib.crc32((request.node.nodeid + os.environ.get("EMBEDCORE_TEST_SEED", "")).encode())
    return np.random.default_rng(seed)


@pytest.fixture
def restore_threads():
    """Restores the engine's thread count after a test that changes it."""
    before = ec.get_num_threads()
    yield before
    ec.set_num_threads(before)
    assert ec.get_num_threads() == before

"""The lookup fuzz target (tests/fuzz/fuzz_lookup.check) on 3,000 fixed
random inputs in the default test run (no atheris needed): every outcome is a
result (checked against the NumPy reference where it applies) or a
ValueError / TypeError / IndexError that leaves the table as it was, and no
lookup changes the table. `FUZZ_TARGET=lookup tests/fuzz/run_fuzz.sh
SECONDS` runs the same target under libFuzzer."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

FUZZ = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fuzz")
sys.path.insert(0, FUZZ)
import fuzz_lookup  # noqa: E402

N_INPUTS, CHUNKS = 3000, 10
FINDINGS = os.path.join(FUZZ, "findings")  # lookup-*: inputs that once failed, kept as regression tests


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(FINDINGS) if n.startswith("lookup-"))
                         if os.path.isdir(FINDINGS) else [])
def test_past_finding(name):
    with open(os.path.join(FINDINGS, name), "rb") as f:
        fuzz_lookup.check(f.read())


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_inputs(chunk):
    rng = np.random.default_rng(2026 + chunk)
    for _ in range(N_INPUTS // CHUNKS):
        data = rng.bytes(int(rng.integers(0, 160)))
        try:
            fuzz_lookup.check(data)
        except BaseException as e:
            raise AssertionError(f"finding for input {data.hex()}: {type(e).__name__}: {e}") from e


def test_the_inputs_reach_every_outcome():
    """Not a vacuous target: fixed inputs give results, reference-checked
    pooled lookups and refusals, each in good number."""
    before = dict(fuzz_lookup.STATS)
    rng = np.random.default_rng(7)
    for _ in range(1500):
        fuzz_lookup.check(rng.bytes(int(rng.integers(0, 160))))
    got = {k: fuzz_lookup.STATS[k] - before[k] for k in before}
    assert got["ok"] >= 250 and got["checked"] >= 150 and got["refused"] >= 250, got

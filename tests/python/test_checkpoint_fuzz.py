"""The fuzz target of tests/fuzz (fuzz_checkpoint.check) over its seed corpus
and 500 deterministic mutations of it, in the default test run (no atheris
needed). Half the mutations are of bytes, half of the manifest's JSON
structure (re-sealed with valid checksums, so they reach the parser and what
reads the parsed manifest). A finding is any outcome other than success,
CheckpointError, ValueError or OSError, or a failed load that changed its
target; tests/fuzz/run_fuzz.sh runs the same target under libFuzzer."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import embedcore as ec

FUZZ = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fuzz")
sys.path.insert(0, FUZZ)
import fuzz_checkpoint  # noqa: E402

CORPUS = os.path.join(FUZZ, "corpus")
FINDINGS = os.path.join(FUZZ, "findings")  # inputs that once failed: kept as regression tests
N_MUTATIONS, CHUNKS = 500, 10

INTERESTING = [None, True, False, 0, -1, 1, 7, 4096, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, 1.5, -0.0, 1e308,
               "", "x", "x" * 300, "../x", "/etc/passwd", "t00000.values.g000000000001.ecd", "float16", "adam",
               [], {}, [0, 0, 0], [1, 0], {"a": 1}, {"feature": 0}, {"dict": {}}]
SPECIAL_BYTES = b'\x00\xff\x7f"{}[],:-9e.\\'


@pytest.fixture(scope="module", autouse=True)
def fuzz_setup(tmp_path_factory):
    threads = ec.get_num_threads()
    fuzz_checkpoint.setup(str(tmp_path_factory.mktemp("fuzz")))  # (one engine thread, as the fuzzer runs)
    yield
    ec.set_num_threads(threads)


def corpus():
    return {n: open(os.path.join(CORPUS, n), "rb").read() for n in sorted(os.listdir(CORPUS))}


def test_corpus_is_the_seeds_the_target_writes():
    assert corpus() == fuzz_checkpoint.corpus_seeds()


@pytest.mark.parametrize("name", sorted(os.listdir(CORPUS)))
def test_corpus_entry(name):
    fuzz_checkpoint.check(corpus()[name])


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(FINDINGS) if not n.startswith("lookup-"))
                         if os.path.isdir(FINDINGS) else [])  # (lookup-*: the lookup target's, test_lookup_fuzz.py)
def test_past_finding(name):
    with open(os.path.join(FINDINGS, name), "rb") as f:
        fuzz_checkpoint.check(f.read())


def _nodes(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, path + (i,))


def _mutate_json(doc, rng):
    paths = [p for p in _nodes(doc) if p]
    path = paths[int(rng.integers(len(paths)))]
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = int(rng.integers(6))
    if op == 0:
        del parent[key]
        return f"delete {path}"
    if op == 1 and isinstance(parent, dict):
        parent[key + "_renamed"] = parent.pop(key)
        return f"rename {path}"
    if op == 2 and isinstance(parent[key], list) and parent[key]:
        parent[key].append(parent[key][int(rng.integers(len(parent[key])))])
        return f"duplicate an element of {path}"
    if op == 3 and isinstance(parent, list) and len(parent) > 1:
        j = int(rng.integers(len(parent)))
        parent[key], parent[j] = parent[j], parent[key]
        return f"swap {path} with [{j}]"
    if op == 4 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = parent[key] + int(rng.integers(-3, 4))
        return f"nudge {path}"
    value = INTERESTING[int(rng.integers(len(INTERESTING)))]
    parent[key] = value
    return f"set {path} = {value!r:.40}"


def _mutate_bytes(data, rng):
    b = bytearray(data)
    ops = []
    for _ in range(int(rng.integers(1, 5))):
        if len(b) < 2:
            b += bytes(rng.integers(0, 256, 8).astype(np.uint8))
            continue
        op = int(rng.integers(6))
        i = int(rng.integers(1, len(b)))  # byte 0 is the selector
        if op == 0:
            b[i] ^= 1 << int(rng.integers(8))
            ops.append(f"flip a bit at {i}")
        elif op == 1:
            b[i] = SPECIAL_BYTES[int(rng.integers(len(SPECIAL_BYTES)))]
            ops.append(f"set byte {i}")
        elif op == 2:
            j = min(len(b), i + int(rng.integers(1, 64)))
            del b[i:j]
            ops.append(f"delete [{i}:{j}]")
        elif op == 3:
            j = min(len(b), i + int(rng.integers(1, 64)))
            b[i:i] = b[i:j]
            ops.append(f"duplicate [{i}:{j}]")
        elif op == 4:
            del b[i:]
            ops.append(f"truncate at {i}")
        else:
            b[0] = int(rng.integers(256))
            ops.append(f"selector {b[0]}")
    return bytes(b), ", ".join(ops)


def mutations(chunk):
    seeds = corpus()
    names = sorted(seeds)
    json_names = [n for n in names if n.endswith(".json")]
    per = N_MUTATIONS // CHUNKS
    for k in range(chunk * per, (chunk + 1) * per):
        rng = np.random.default_rng([7, k])
        if k % 2:
            name = json_names[int(rng.integers(len(json_names)))]
            data = seeds[name]
            doc = json.loads(data[1:])
            what = "; ".join(_mutate_json(doc, rng) for _ in range(int(rng.integers(1, 4))))
            yield k, name, what, data[:1] + json.dumps(doc).encode()
        else:
            name = names[int(rng.integers(len(names)))]
            data, what = _mutate_bytes(seeds[name], rng)
            yield k, name, what, data


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_mutations(chunk):
    findings = []
    for k, name, what, data in mutations(chunk):
        try:
            fuzz_checkpoint.check(data)
        except Exception as e:  # noqa: BLE001 - every other exception is a finding
            findings.append(f"mutation {k} of {name} ({what}): {type(e).__name__}: {str(e)[:200]}")
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings)

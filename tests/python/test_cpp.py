"""Builds the C++ unit tests (tests/cpp) and runs them with ctest, so that
``python -m pytest`` runs every test of the project, Python and C++.

The build lives in build/ctest inside the repository and is reused between
runs (only what changed is rebuilt). It uses the ``cmake`` on PATH (the one
``pip install ".[test]"`` installs; this interpreter's scripts directory is
searched first, so an unactivated virtual environment works too) with Ninja,
and this interpreter for the build's Python look-ups (nlohmann-json's
headers). The test is skipped only
when cmake or a C++ compiler is missing; any configure, build or test failure
fails it with the tool's output.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "ctest"

# Generous: the first build compiles the core and every test (about a minute on 2 cores).
CONFIGURE_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 1800
CTEST_TIMEOUT_S = 1800


def _search_path() -> str:
    return os.pathsep.join(p for p in (sysconfig.get_path("scripts"), os.environ.get("PATH", "")) if p)


def _which(name):
    return shutil.which(name, path=_search_path())


def _cxx_compiler():
    """The C++ compiler CMake would pick: $CXX, else c++ / g++ / clang++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return _which(cxx.split()[0])
    for name in ("c++", "g++", "clang++"):
        found = _which(name)
        if found:
            return found
    return None


def _cache_value(key: str):
    cache = BUILD / "CMakeCache.txt"
    if not cache.is_file():
        return None
    m = re.search(rf"^{re.escape(key)}:[A-Z]+=(.*)$", cache.read_text(errors="replace"), re.M)
    return m.group(1) if m else None


def _stale(generator) -> bool:
    if not (BUILD / "CMakeCache.txt").is_file():
        return False
    home = _cache_value("CMAKE_HOME_DIRECTORY")
    command = _cache_value("CMAKE_COMMAND")
    cached_generator = _cache_value("CMAKE_GENERATOR")
    return ((home is not None and os.path.realpath(home) != os.path.realpath(REPO))
            or (command is not None and not os.path.exists(command))
            or (generator is not None and cached_generator != generator)
            or (generator is None and cached_generator == "Ninja"))


def _run(cmd, timeout, what):
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env={**os.environ, "PATH": _search_path()})
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"{what} timed out after {timeout} s: {' '.join(map(str, cmd))}\n{out[-20000:]}", pytrace=False)
    return proc


@contextlib.contextmanager
def _build_lock():
    """Serializes pytest runs that share build/ctest (two sessions in one
    checkout, or pytest-xdist): concurrent ninja runs corrupt its logs."""
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD.parent / ".ctest.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def test_cpp_unit_tests():
    with _build_lock():
        _build_and_run()


def _build_and_run():
    cmake = _which("cmake")
    if cmake is None:
        pytest.skip("cmake is not on PATH (pip install '.[test]' installs it): the C++ tests were not built")
    if _cxx_compiler() is None:
        pytest.skip("no C++ compiler found ($CXX, c++, g++ or clang++): the C++ tests were not built")
    ctest = str(Path(cmake).with_name("ctest")) if Path(cmake).with_name("ctest").exists() else _which("ctest")
    if ctest is None:
        pytest.fail(f"cmake is at {cmake} but ctest is missing", pytrace=False)
    generator = "Ninja" if _which("ninja") else None

    # A build directory made by another checkout, by a cmake that is gone (an
    # old virtual environment) or with another generator cannot be reused.
    if _stale(generator):
        shutil.rmtree(BUILD)
    BUILD.mkdir(parents=True, exist_ok=True)

    configure = [cmake, "-S", str(REPO), "-B", str(BUILD), "-DEMBEDCORE_PYTHON=OFF", "-DEMBEDCORE_TESTS=ON",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"]
    if generator:
        configure[1:1] = ["-G", generator]
    proc = _run(configure, CONFIGURE_TIMEOUT_S, "cmake configure")
    if proc.returncode != 0:
        pytest.fail(f"cmake configure failed (exit {proc.returncode}):\n{proc.stdout[-20000:]}", pytrace=False)

    proc = _run([cmake, "--build", str(BUILD)], BUILD_TIMEOUT_S, "cmake --build")
    if proc.returncode != 0:
        pytest.fail(f"building the C++ tests failed (exit {proc.returncode}):\n{proc.stdout[-20000:]}", pytrace=False)

    jobs = str(max(1, min(os.cpu_count() or 1, 4)))
    proc = _run([ctest, "--test-dir", str(BUILD), "--output-on-failure", "--no-tests=error", "-j", jobs],
                CTEST_TIMEOUT_S, "ctest")
    summary = re.search(r"^\d+% tests passed.*$", proc.stdout, re.M)
    if proc.returncode != 0:
        failed = re.findall(r"^\s*\d+ - (\S+) \(", proc.stdout, re.M)
        names = f" ({', '.join(failed)})" if failed else ""
        pytest.fail(f"C++ tests failed{names}: {summary.group(0) if summary else 'see the output'}\n"
                    f"{proc.stdout[-30000:]}", pytrace=False)
    assert summary is not None, f"ctest printed no summary:\n{proc.stdout[-5000:]}"
    print(summary.group(0))
    # ctest counts a skipped test (exit 77: a tool it needs is missing) as passed: say which, so it is seen.
    skipped = re.findall(r"^\s*\d+ - (\S+) \(Skipped\)", proc.stdout, re.M)
    if skipped:
        warnings.warn(f"C++ tests skipped by ctest: {', '.join(skipped)} (see tests/cpp/CMakeLists.txt for what "
                      "each needs)", stacklevel=2)

"""examples/c_inference built against an installed embedcore, out of tree
(``find_package(embedcore CONFIG)`` with the path of ``python -m embedcore
--cmake-dir``): its C program (inference.c) and its C++ server (serve.cpp)
open a checkpoint written from Python, and their lookups must equal the
Python serving path's bit for bit.

Run by pytest against the installed package (a wheel, or an editable
install), and by ctest (tests/cpp/CMakeLists.txt) as a script against the
build tree it was configured in::

    python tests/python/test_c_api_example.py --build-tree BUILD --work-dir DIR [--sanitize]

which installs BUILD into DIR/stage (``cmake --install``) and builds the
example against that. The script exits 77 (ctest's "skipped") when this
Python cannot import embedcore, which writes the checkpoint.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "c_inference"
SKIP = 77
# An editable install rebuilds on import and would print a line of its own.
ENV = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
SANITIZE_FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"


def _search_path() -> str:
    return os.pathsep.join(p for p in (sysconfig.get_path("scripts"), os.environ.get("PATH", "")) if p)


def which(name: str) -> Optional[str]:
    return shutil.which(name, path=_search_path())


def run(cmd: List[str], what: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env={**ENV, "PATH": _search_path()}, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-20000:]}")
    return proc


def cmake_dir_of_installed_package() -> Path:
    """What ``python -m embedcore --cmake-dir`` prints (its last line)."""
    proc = run([sys.executable, "-m", "embedcore", "--cmake-dir"], "python -m embedcore --cmake-dir", timeout=600)
    return Path(proc.stdout.strip().splitlines()[-1])


def load_make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint", EXAMPLE / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_example(cmake_dir: Path, build: Path, generator: Optional[str] = None, sanitize: bool = False) -> Path:
    """Configures and builds examples/c_inference into `build`; returns it."""
    cmake = which("cmake")
    if cmake is None:
        raise FileNotFoundError("cmake is not on PATH")
    if generator is None and which("ninja"):
        generator = "Ninja"
    configure = [cmake, "-S", EXAMPLE, "-B", build, f"-Dembedcore_DIR={cmake_dir}", "-DCMAKE_BUILD_TYPE=Release"]
    if generator:
        configure += ["-G", generator]
    if sanitize:
        configure += [f"-DCMAKE_C_FLAGS={SANITIZE_FLAGS}", f"-DCMAKE_CXX_FLAGS={SANITIZE_FLAGS}",
                      "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined", "-DCMAKE_BUILD_TYPE=Debug"]
    if (build / "CMakeCache.txt").exists():
        shutil.rmtree(build)  # another configuration or another package: start afresh
    run(configure, "configuring examples/c_inference")
    run([cmake, "--build", build], "building examples/c_inference")
    return build


def check_example(build: Path, work: Path) -> str:
    """Writes the example checkpoint from Python, runs both programs and
    compares their --dump output with Python's lookups; returns inference's
    output. Raises AssertionError on a mismatch."""
    import numpy as np

    mc = load_make_checkpoint()
    ckpt = work / "ckpt"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    mc.save_example(str(ckpt))
    reference = mc.reference_lookups(str(ckpt))
    expected = b"".join(o.astype("<f4").tobytes() for o in reference)
    assert len(expected) > 1000

    out_c, out_cpp = work / "c.bin", work / "cpp.bin"
    shown = run([build / "inference", ckpt, "--dump", out_c], "the C program (inference)").stdout
    run([build / "serve", ckpt, "--dump", out_cpp], "the C++ program (serve --dump)")
    for name, path in (("C (inference.c)", out_c), ("C++ (serve.cpp)", out_cpp)):
        got = path.read_bytes()
        if got != expected:
            a = np.frombuffer(got, "<f4")
            b = np.frombuffer(expected, "<f4")
            n = min(len(a), len(b))
            diff = np.nonzero(a[:n].view(np.uint32) != b[:n].view(np.uint32))[0]
            raise AssertionError(f"{name} lookups differ from Python's: {len(a)} vs {len(b)} floats, "
                                 f"{len(diff)} differing bits, first at {diff[:5].tolist()}")
    assert "an id out of range: status 2" in shown, shown
    return shown


# ---------------------------------------------------------------- pytest
def _require_tools():
    import pytest

    if which("cmake") is None:
        pytest.skip("cmake is not on PATH (pip install '.[test]' installs it)")
    if not any(which(c) for c in ("cc", "gcc", "clang")) or not any(which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C and C++ compiler")


def test_cmake_dir_points_at_the_package():
    cmake_dir = cmake_dir_of_installed_package()
    assert (cmake_dir / "embedcoreConfig.cmake").is_file()
    assert (cmake_dir / "embedcoreConfigVersion.cmake").is_file()
    root = cmake_dir.parents[2]  # <package>/share/cmake/embedcore
    assert (root / "lib" / "libembedcore.so").is_file()
    for header in ("c_api.h", "embedcore.hpp", "version.h"):
        assert (root / "include" / "embedcore" / header).is_file(), header


def test_example_against_installed_package(tmp_path):
    """The issue's check: C, C++ and Python lookups of one checkpoint are bit-identical."""
    _require_tools()
    build = build_example(cmake_dir_of_installed_package(), tmp_path / "build")
    shown = check_example(build, tmp_path)
    assert "feature 'history' -> table 'item', sequence of 5" in shown

    # serve: throughput and latency for batch sizes 1..512 from 2 threads, with hot reload meanwhile.
    mc = load_make_checkpoint()
    mc.save_example(str(tmp_path / "ckpt2"), seed=7)
    out = run([build / "serve", tmp_path / "ckpt", "--threads", "2", "--seconds", "0.03",
               "--reload", tmp_path / "ckpt2", "--reload-ms", "5"], "serve").stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [2 ** k for k in range(10)], out
    assert all(float(r[1]) > 0 for r in rows), out
    assert sum(int(r[5]) for r in rows) > 0, out  # it did reload


# ---------------------------------------------------------------- ctest
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-tree", required=True, type=Path, help="an embedcore build tree (with EMBEDCORE_C_API=ON)")
    p.add_argument("--work-dir", required=True, type=Path)
    p.add_argument("--generator", default=None)
    p.add_argument("--sanitize", action="store_true", help="build the example with ASan + UBSan")
    args = p.parse_args(argv)
    try:
        import embedcore  # noqa: F401  (writes the checkpoint and the reference)
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"skipped: this Python ({sys.executable}) cannot import embedcore: {e}")
        return SKIP
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    stage = work / "stage"
    if stage.exists():
        shutil.rmtree(stage)
    run([which("cmake") or "cmake", "--install", args.build_tree, "--prefix", stage], "cmake --install")
    cmake_dir = stage / "embedcore" / "share" / "cmake" / "embedcore"
    build = build_example(cmake_dir, work / "build", args.generator, args.sanitize)
    shown = check_example(build, work)
    print(shown)
    print("C, C++ and Python lookups are bit-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

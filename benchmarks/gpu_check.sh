#!/usr/bin/env bash
# The GPU check of issue #8, one prepared script for a machine with an NVIDIA
# GPU (under 8 minutes): builds the CUDA variant of embedcore, runs the GPU
# tests, then the GPU benchmark W1g against PyTorch's embedding_bag.
#
#   bash benchmarks/gpu_check.sh            # results and logs in $OUT (default /tmp/gpu_check)
#
# Needs: nvcc (CUDA 12.x/13), CMake, ninja, a Python with numpy, pytest, nanobind,
# scikit-build-core and a CUDA build of PyTorch, and nlohmann-json (the PyPI
# package; where the machine cannot reach PyPI, put its wheel in .whl/ first:
# `pip download --no-deps -d .whl nlohmann-json`; with the device tool, .whl/ is
# git-ignored, so name it in `carry`). EMBEDCORE_CUDA_ARCHS picks the
# architectures (default: the GPU's own, from nvidia-smi, else 90). The package is
# built into $PKG (default /tmp/gpu_check_pkg), outside $OUT, which holds only
# the logs and the JSON. The GPU tests, the NCCL tests and the benchmark are
# stopped after GPU_TESTS_TIMEOUT (default 150), GPU_NCCL_TIMEOUT (45) and
# GPU_BENCH_TIMEOUT (180) seconds, so that a hang still leaves time for the rest
# and the whole run, build included, stays under 8 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1  # output reaches the logs as it happens, also if a time limit stops the run
START=$SECONDS
PY=${PYTHON:-python3}
export PATH="$PATH:/usr/local/cuda/bin"  # where the toolkit usually is, if not on PATH already
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
say() { printf '\n=== [%4ds] %s\n' "$((SECONDS - START))" "$*"; }

say "machine"
nvidia-smi -L || echo "nvidia-smi: not found"
{ nvcc --version || echo "nvcc: not found"; } | tail -1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
ARCH=${EMBEDCORE_CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.' || true)}
ARCH=${ARCH:-90}
echo "CUDA architectures: $ARCH"

say "build dependencies"
"$PY" - <<'PYEOF'
import importlib.util, shutil, sys
missing = [m for m in ("numpy", "pytest", "nanobind", "scikit_build_core", "torch") if importlib.util.find_spec(m) is None]
missing += [t for t in ("cmake", "ninja", "nvcc") if shutil.which(t) is None]
if missing:
    sys.exit(f"gpu_check: missing {missing}: install them (or carry their wheels in .whl/) first")
PYEOF
# The build only reads the header the wheel ships (CMakeLists.txt finds the
# package with find_spec): its own Python dependency (importlib-resources) is
# not needed, and an offline machine may not have it, hence --no-deps.
# Installed into a folder of its own (on PYTHONPATH, which the build's CMake
# inherits): the machine's Python environment may not be writable.
DEPS=${DEPS:-/tmp/gpu_check_deps}
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"  # (a rerun finds what the first run installed)
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('nlohmann_json') is None)"; then
  PIP=("$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --upgrade --target "$DEPS")
  "${PIP[@]}" --no-index --find-links .whl nlohmann-json ||
    "${PIP[@]}" --retries 0 --timeout 5 nlohmann-json ||
    { echo "gpu_check: nlohmann-json is missing: put its wheel in .whl/ (see the header)"; exit 1; }
fi

PKG=${PKG:-/tmp/gpu_check_pkg}
say "build the CUDA variant (EMBEDCORE_CUDA=ON, sm_$ARCH) into $PKG"
rm -rf "$PKG"
"$PY" -m pip install --disable-pip-version-check --no-deps --no-build-isolation --target "$PKG" \
  -C cmake.define.EMBEDCORE_CUDA=ON -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$ARCH" \
  -C build-dir=build/gpu-check . 2>&1 | tee "$OUT/build.log" | tail -3
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
# The tests must import this build: an editable (or other) install of embedcore
# in this Python can come first, and would quietly test the CPU build.
"$PY" - "$PKG" <<'PYEOF'
import os, sys
import embedcore
pkg, where = os.path.realpath(sys.argv[1]), os.path.realpath(embedcore.__file__)
info = embedcore.build_info()
print(where, info)
if not where.startswith(pkg + os.sep) or not info["cuda"]:
    sys.exit(f"gpu_check: this Python imports embedcore from {where}, not the CUDA build in {pkg}: another "
             "install of embedcore (e.g. an editable one) comes first; uninstall it or use a fresh environment")
PYEOF

# Each step is bounded, so that one that hangs on the GPU (a deadlock, a kernel
# that never ends, NCCL's set-up) still leaves time for the next: exit 124 then
# names the timeout. The NCCL tests run last, on their own.
tests_rc=0
run_tests() {  # name, seconds, pytest arguments...
  local name=$1 limit=$2 rc
  shift 2
  set +e
  timeout --kill-after=10 "$limit" "$PY" -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && echo "gpu_check: $name was stopped (past $limit s, or killed: 137)"
  [ "$rc" -ne 0 ] && tests_rc=$rc
  return 0
}
say "GPU tests (tests/python/test_cuda.py, test_torch_cuda.py: the same bodies on cpu and cuda)"
run_tests tests "${GPU_TESTS_TIMEOUT:-150}" -k "not nccl" tests/python/test_cuda.py tests/python/test_torch_cuda.py
say "NCCL tests (world size 1)"
run_tests tests_nccl "${GPU_NCCL_TIMEOUT:-45}" -k nccl tests/python/test_cuda.py

say "GPU benchmark W1g (benchmarks/bench_gpu.py)"
set +e
timeout --kill-after=10 "${GPU_BENCH_TIMEOUT:-180}" "$PY" benchmarks/bench_gpu.py --json "$OUT/gpu.json" 2>&1 |
  tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
set -e
{ [ "$bench_rc" -eq 124 ] || [ "$bench_rc" -eq 137 ]; } &&
  echo "gpu_check: the benchmark was stopped (past ${GPU_BENCH_TIMEOUT:-180} s, or killed: 137)"
[ "$bench_rc" -eq 3 ] && echo "gpu_check: the benchmark ran, and missed a target (see above)"

say "done in $((SECONDS - START)) s; tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"

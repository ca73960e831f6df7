#!/usr/bin/env bash
# Runs the checkpoint fuzz target for a bounded time (for CI):
#     tests/fuzz/run_fuzz.sh SECONDS [extra libFuzzer flags]
# New inputs go to a scratch corpus (tests/fuzz/corpus is only read);
# a finding is written to $FUZZ_ARTIFACTS (default: a temporary directory)
# and makes the script exit non-zero. Needs `pip install atheris`.
set -euo pipefail
seconds="${1:?usage: run_fuzz.sh SECONDS [libFuzzer flags]}"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
"$python" -c "import atheris" 2>/dev/null || { echo "run_fuzz.sh: atheris is not installed (pip install atheris)" >&2; exit 2; }
work="$(mktemp -d)"
artifacts="${FUZZ_ARTIFACTS:-$(mktemp -d)}"
mkdir -p "$artifacts"
trap 'rm -rf "$work"' EXIT
export SKBUILD_EDITABLE_VERBOSE=0
echo "fuzzing checkpoint reading for ${seconds} s; findings go to ${artifacts}" >&2
set +e
"$python" "$here/fuzz_checkpoint.py" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 \
    -dict="$here/manifest.dict" -artifact_prefix="$artifacts/" "$@" "$work" "$here/corpus"
rc=$?
set -e
if [ $rc -ne 0 ]; then
    echo "run_fuzz.sh: a finding (exit $rc); reproduce with: $python $here/fuzz_checkpoint.py $artifacts/<file>" >&2
    ls -l "$artifacts" >&2 || true
fi
exit $rc

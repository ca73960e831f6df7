#!/usr/bin/env bash
# Runs a fuzz target for a bounded time (for CI):
#     tests/fuzz/run_fuzz.sh SECONDS [extra libFuzzer flags]
# FUZZ_TARGET picks it: checkpoint (the default: fuzz_checkpoint.py, the
# checkpoint reader, from the seed corpus tests/fuzz/corpus) or lookup
# (fuzz_lookup.py, the lookup and update input paths, from nothing).
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
target="${FUZZ_TARGET:-checkpoint}"
echo "fuzzing the ${target} target for ${seconds} s; findings go to ${artifacts}" >&2
set +e
case "$target" in
  checkpoint)
    "$python" "$here/fuzz_checkpoint.py" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 \
        -dict="$here/manifest.dict" -artifact_prefix="$artifacts/" "$@" "$work" "$here/corpus" ;;
  lookup)
    "$python" "$here/fuzz_lookup.py" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 \
        -artifact_prefix="$artifacts/" "$@" "$work" ;;
  *)
    echo "run_fuzz.sh: FUZZ_TARGET must be checkpoint or lookup, got '$target'" >&2; exit 2 ;;
esac
rc=$?
set -e
if [ $rc -ne 0 ]; then
    echo "run_fuzz.sh: a finding (exit $rc); reproduce with: $python $here/fuzz_${target}.py $artifacts/<file>" >&2
    ls -l "$artifacts" >&2 || true
fi
exit $rc

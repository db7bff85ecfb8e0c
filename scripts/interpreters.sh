#!/usr/bin/env bash
# The walk, pattern, plan and layout-read tests on every CPython from 3.10 to 3.13 this machine
# has besides the default one, each in its own cached environment, with the layout reads on and
# with MESHBIND_NO_LAYOUT_READS=1. A version the machine lacks, or one the pinned requirements
# cannot be installed on (no torch wheel for it), is skipped with one line saying so.
set -euo pipefail
repo_root=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo_root"
default=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
modules=(tests/test_walk.py tests/test_patterns.py tests/test_plan.py tests/test_layout_reads.py)

find_interpreter() {
    local version=$1 candidate
    for candidate in "python$version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
        if "$candidate" -c 'import sys' >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

for version in 3.10 3.11 3.12 3.13; do
    [ "$version" = "$default" ] && continue
    if ! interpreter=$(find_interpreter "$version"); then
        echo "interpreters: skipped CPython $version: not on this machine"
        continue
    fi
    key="py$version-$(sha256sum requirements-dev.txt | cut -c1-12)"
    if [ ! -f "${XDG_CACHE_HOME:-$HOME/.cache}/meshbind/venv-$key/.complete" ]; then
        if ! why=$("$interpreter" -m pip install --dry-run --quiet --disable-pip-version-check -r requirements-dev.txt 2>&1); then
            reason=$(printf '%s\n' "$why" | grep -m1 'No matching distribution' || printf '%s\n' "$why" | tail -n 1)
            echo "interpreters: skipped CPython $version: requirements-dev.txt cannot be installed there (${reason#ERROR: })"
            continue
        fi
    fi
    echo "interpreters: CPython $version ($interpreter)"
    MESHBIND_PYTHON="$interpreter" bash -c '
        set -euo pipefail
        source scripts/env.sh
        python -m pytest -q -p no:cacheprovider "$@"
        MESHBIND_NO_LAYOUT_READS=1 python -m pytest -q -p no:cacheprovider "$@"
    ' interpreters "${modules[@]}"
done

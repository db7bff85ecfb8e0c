#!/usr/bin/env bash
# Every test: the Rust unit tests, the Python suite, the walk, pattern, plan and layout-read tests
# again with MESHBIND_NO_LAYOUT_READS=1, then those on the other CPython versions this machine has.
# Debian's chromium and chromium-driver are installed first when missing (scripts/browser.sh).
# `bash scripts/test.sh [pytest args]` runs only the Python suite with those arguments.
source "$(dirname "$0")/env.sh"
cd "$repo_root"
bash scripts/browser.sh  # the headless Chromium of the --html test
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
cargo test --quiet
python -m pytest -q --durations=20  # the slowest tests named, where the suite's time goes
MESHBIND_NO_LAYOUT_READS=1 python -m pytest -q tests/test_walk.py tests/test_patterns.py tests/test_plan.py tests/test_layout_reads.py
bash scripts/interpreters.sh

#!/usr/bin/env bash
# Every test: the Rust unit tests, then the Python suite. `bash scripts/test.sh [pytest args]`.
source "$(dirname "$0")/env.sh"
cd "$repo_root"
cargo test --quiet
python -m pytest -q "$@"

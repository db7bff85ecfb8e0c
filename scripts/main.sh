#!/usr/bin/env bash
# The main job on its embedded default: `bash scripts/main.sh [meshbind demo flags]`.
source "$(dirname "$0")/env.sh"
meshbind demo "$@"

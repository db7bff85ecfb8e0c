#!/usr/bin/env bash
# The headless browser the --html test drives: Debian's chromium and its chromedriver, installed
# once from the distribution's packages (selenium then needs no driver download).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
echo "browser: installing Debian's chromium and chromium-driver (first run only)" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null

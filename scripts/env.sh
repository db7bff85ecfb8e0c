# Sourced by the README commands: finds or builds the cached virtual environment, then builds
# the Rust extension into it from this checkout.
#
# The environment lives outside the checkout, keyed by the interpreter's version and a hash of
# requirements-dev.txt, so a fresh clone (CI) reuses one built before and builds it when there is
# none. MESHBIND_PYTHON picks the interpreter (default: python3); scripts/interpreters.sh uses it.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
requirements="$repo_root/requirements-dev.txt"
interpreter="${MESHBIND_PYTHON:-python3}"
version=$("$interpreter" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key="py$version-$(sha256sum "$requirements" | cut -c1-12)"
venv="${MESHBIND_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/meshbind/venv-$key}"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    echo "meshbind: building the CPython $version environment in $venv (first run only: torch is large)" >&2
    rm -rf "$venv"
    "$interpreter" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
    touch "$venv/.complete"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
# Build the extension from this checkout and install the package editable into the environment,
# pointing it at this checkout (incremental after the first time; a fresh clone re-points it).
build_log=$(mktemp)
# With what only the tests call, which a wheel leaves out (Cargo.toml's test-hooks feature).
if ! (cd "$repo_root" && maturin develop --release --features test-hooks >"$build_log" 2>&1); then
    cat "$build_log" >&2
    exit 1
fi
rm -f "$build_log"

"""The extension's type stub (python/meshbind/_core.pyi) says what the extension has."""

import subprocess
import sys


def test_the_stub_matches_the_extension() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "meshbind._core"], capture_output=True, text=True, timeout=300, check=False
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]

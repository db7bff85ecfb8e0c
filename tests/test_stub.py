"""The extension's type stub (python/meshbind/_core.pyi) says what the extension has."""

import subprocess
import sys
from pathlib import Path


def test_the_stub_matches_the_extension(tmp_path: Path) -> None:
    # The stub imports nothing of torch; following the package's other imports into torch would
    # cost stubtest a minute and check nothing of the stub.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = skip\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "meshbind._core", "--mypy-config-file", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]

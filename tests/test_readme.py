"""The README's end-to-end example runs as written (plan, check, bind, run) and prints what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from meshbind.launch import free_port

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_first_plan_example_checks_binds_and_runs() -> None:
    text = README.read_text()
    section = text.split("## A first plan", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    # The example's fixed port, replaced by a free one so parallel runs do not collide.
    script = code.group(1).replace("tcp://127.0.0.1:29511", f"tcp://127.0.0.1:{free_port()}")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "unmatched (pattern): pattern 'haed' does not select any module; did you mean 'head'?" in out
    assert "1 planned module; layout pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1" in out
    assert out.strip().endswith("torch.Size([2, 16])")

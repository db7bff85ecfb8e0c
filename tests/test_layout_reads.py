"""The in-place reads of CPython's object layout: the switch, the guards' verdict, the self-check,
and the same answers with the reads on and off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from meshbind import _core

SWITCH = "MESHBIND_NO_LAYOUT_READS"
KNOWN = sys.version_info[:2] in {(3, 10), (3, 11), (3, 12), (3, 13)} and sys.maxsize > 2**32 and sys.byteorder == "little"
DICT_READS = KNOWN and sys.version_info >= (3, 11) and platform.machine() in ("x86_64", "AMD64")
TEXT_FIELDS = ["list_items", "str_length", "str_state", "str_text"]
DICT_FIELDS = ["dict_used", "dict_keys", "keys_entry_count", "managed_dict"]

# Matches and a walk over a tree, printed as JSON by a fresh interpreter.
PROBE = """
import json
from meshbind import PatternSet, _core
from meshbind.examples.moe_tree import DEEP_PLAN, build_moe_tree, moe_tree_fqns
tree = build_moe_tree(3, 20)
patterns = PatternSet([*DEEP_PLAN, "**.down_proj", "layers.<1-2>.**"])
names = moe_tree_fqns(3, 20) + ["caf\\u00e9.x", "layers.0.self_attn"]
found = patterns.match_indices(names)
print(json.dumps({
    "status": _core.layout_reads(),
    "walk": patterns.walk(tree, prune=False).matches(),
    "pruned": patterns.walk(tree, prune=True, modules=True).matches(),
    "many": patterns.match_many(names),
    "indices": [list(found.names), list(found.patterns), found.counts],
}))
"""


def _probe(switched_off: bool) -> dict[str, object]:
    environment = {key: value for key, value in os.environ.items() if key != SWITCH}
    if switched_off:
        environment[SWITCH] = "1"
    done = subprocess.run([sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_switch_turns_every_read_off_and_the_answers_stay_the_same() -> None:
    on, off = _probe(switched_off=False), _probe(switched_off=True)
    assert off["status"] == f"off: {SWITCH} is set"
    if KNOWN:
        assert on["status"] == ("on" if DICT_READS else "on (list and str reads; dicts through the C API on this interpreter)")
    else:
        assert str(on["status"]).startswith("off: CPython")
    assert {key: value for key, value in on.items() if key != "status"} == {
        key: value for key, value in off.items() if key != "status"
    }


def test_this_process_reports_the_switch_it_was_started_with() -> None:
    status = _core.layout_reads()
    if os.environ.get(SWITCH, "") not in ("", "0"):
        assert status == f"off: {SWITCH} is set"
    elif KNOWN:
        assert status.startswith("on")


@pytest.mark.skipif(not KNOWN, reason="no known layout on this interpreter: every read goes through the C API")
def test_the_self_check_agrees_with_the_known_offsets() -> None:
    assert _core._layout_self_check(None) is None


@pytest.mark.skipif(not KNOWN, reason="no known layout on this interpreter: every read goes through the C API")
@pytest.mark.parametrize("field", TEXT_FIELDS + DICT_FIELDS)
def test_the_self_check_finds_each_offset_moved_by_a_word(field: str) -> None:
    if field in DICT_FIELDS and not DICT_READS:
        with pytest.raises(ValueError, match=f"no offset '{field}'|no offset \"{field}\""):
            _core._layout_self_check(field)
        return
    found = _core._layout_self_check(field)
    assert found is not None and found.startswith("self-check: ")


def test_the_self_check_hook_is_the_test_builds_alone() -> None:
    """``_layout_self_check`` (and ``ModuleTree``'s test-only methods) are compiled only with the
    ``test-hooks`` feature: the test command's build turns it on, a wheel's (pyproject's maturin
    features) does not."""
    root = Path(__file__).resolve().parent.parent
    assert "maturin develop --release --features test-hooks" in (root / "scripts" / "env.sh").read_text()
    maturin = (root / "pyproject.toml").read_text().split("[tool.maturin]", 1)[1].split("\n[", 1)[0]
    assert "features = []" in maturin and "test-hooks" not in maturin
    assert hasattr(_core, "_layout_self_check")


def test_an_unknown_offset_name_is_refused() -> None:
    with pytest.raises(ValueError, match="no offset"):
        _core._layout_self_check("ob_refcnt")

"""``lifecycle.ledger``: one owner for the bookkeeping. The rule "no module of the core writes
another's private state" read off the source: outside ``ledger.py`` no module of ``lifecycle/``
assigns into the ledger (``x._ledger.y = ...``, ``x._ledger.y[k] = ...``, ``+=``), into another
object's private attribute (``mgr._x = ...``; ``self._x`` is a module's own), or into a field of
a ``Record`` (``rec.inflight``, ``rec.offload.inc_len``, ...: only the machine sets ``rec.state``).
``table.py`` is exempt for its deep copy, which builds a new ledger."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lifecycle"
RECORD_FIELDS = {"ref", "rid", "row", "offload", "logger", "inflight", "slots", "generation", "expired", "serial",
                 "inc_len", "last_hash"}
MODULES = sorted(p for p in ROOT.glob("*.py") if p.name not in ("ledger.py", "table.py"))


def chain(node) -> list[str]:
    """``a.b[c].d`` -> ["a", "b", "d"] (names and attributes, subscripts skipped)."""
    out = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def writes(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, (ast.Attribute, ast.Subscript)):
                    yield node.lineno, chain(leaf)


def violation(names: list[str]) -> str | None:
    if "_ledger" in names[:-1]:
        return "writes the ledger's state"
    if len(names) == 2 and names[0] != "self" and names[1].startswith("_") and not names[1].startswith("__"):
        return "writes another object's private attribute"
    if names and names[0] in ("rec", "record") and len(names) > 1 and names[1] in RECORD_FIELDS:
        return "writes a record's field"
    if len(names) > 2 and names[-2] == "rec" and names[-1] in RECORD_FIELDS:
        return "writes a record's field"
    return None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_core_module_writes_the_ledgers_or_anothers_private_state(path):
    found = [f"{path.name}:{line}: {'.'.join(names)} ({why})"
             for line, names in writes(path) if (why := violation(names)) is not None]
    assert found == []


def test_the_check_sees_the_writes_it_forbids():
    src = "mgr._ledger.records[1] = 2\nmgr._released += 1\nrec.inflight -= 1\nchunk.rec.offload.inc_len = 3\nself._x = 1\n"
    found = [violation(names) for _, names in writes_src(src)]
    assert found == ["writes the ledger's state", "writes another object's private attribute",
                     "writes a record's field", None, None]


def writes_src(src: str):
    tmp = Path(__file__).with_name("_ledger_rule_probe.py")
    try:
        tmp.write_text(src)
        return list(writes(tmp))
    finally:
        tmp.unlink()

"""The replay reads its rules from lifecycle.states (a guard added there changes what it accepts),
and type-mutated logs never raise: each bad field is a violation on its line."""

import json
import random

import pytest

from lifecycle import states
from lifecycle_tools.replay import replay
from tests.tools.test_replay import Log, good


def finish_under_a_copy():
    log = Log().chunk("a", 1, 8, 12, land=False)
    log.tr("a", "finish", "INFLIGHT", "FINISHED")        # allowed: finishing does not free anything
    log.land("a", 1, 8, 12, then=None)
    log.add("released", rid="a", row=0, gen=0, ranges=[[0, 14]], slots=14, committed=14, allocated=14)
    log.tr("a", "release", "FINISHED", "RELEASED")
    return log.lines()


def test_a_guard_added_to_the_table_changes_what_replay_accepts(monkeypatch):
    assert replay(finish_under_a_copy()).ok
    rows = tuple(dict(row, unless="copies_in_flight") if row["trigger"] == "finish" else row
                 for row in states.TRANSITIONS)
    monkeypatch.setattr(states, "TRANSITIONS", rows)
    r = replay(finish_under_a_copy())
    msgs = [(v.line, v.message) for v in r.violations]
    assert any(line == 4 and "refused by the declared table" in m and "copies_in_flight" in m for line, m in msgs), msgs


def test_a_transition_removed_from_the_table_becomes_illegal(monkeypatch):
    rows = tuple(row for row in states.TRANSITIONS if row["trigger"] != "readmit")
    monkeypatch.setattr(states, "TRANSITIONS", rows)
    log = Log().release("a", 8).tr("a", "readmit", "RELEASED", "PREFILLED").release("a", 8, gen=1)
    assert any("illegal transition 'readmit'" in v.message for v in replay(log.lines()).violations)


MUTANTS = [["x"], {"k": 1}, "text", 1.5, True, None, -1, 2**70, [], [[1, "a"]], {"event": 1}]


def test_type_mutated_logs_never_raise_and_name_the_line():
    rng = random.Random(0)
    base = [json.loads(s) for s in good().lines()]
    flagged = 0
    for _ in range(3000):
        events = [dict(e) for e in base]
        i = rng.randrange(len(events))
        field = rng.choice(sorted(events[i]))
        events[i][field] = rng.choice(MUTANTS)
        r = replay(json.dumps(e) for e in events)       # must not raise
        if any(v.line == i + 1 for v in r.violations):
            flagged += 1
    assert flagged > 1500      # most mutations are caught on their own line (some are harmless: t, pages)


@pytest.mark.parametrize("value", [["a"], {"x": 1}])
def test_unhashable_rid_is_a_violation(value):
    lines = good().lines()
    ev = json.loads(lines[0])
    ev["rid"] = value
    r = replay([json.dumps(ev)] + lines[1:])
    assert any(v.line == 1 and "'rid'" in v.message for v in r.violations)

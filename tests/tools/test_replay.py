"""Audit-log replay: hand-built logs (each rule on its own) and a real simulator log, corrupted."""

import json
import subprocess
import sys

import pytest

from lifecycle_tools.replay import declared_table, format_report, replay

SMALL = ["--requests", "10", "--turns", "2", "--prompt-len", "8-40", "--output-len", "12-40",
         "--layers", "2", "--heads", "2", "--head-dim", "8", "--page-size", "4", "--device-tokens", "1024",
         "--host-tokens", "256", "--rows", "6", "--retract-frac", "0.5", "--abort-frac", "0.2",
         "--arrival-rate", "0", "--seed", "3", "--no-progress"]


class Log:
    """Builds a manager-shaped audit log, one event per line."""

    def __init__(self):
        self.events = []
        self.t = 0.0

    def add(self, event, **kw):
        self.t += 0.001
        self.events.append(dict(event=f"lifecycle.{event}", t=round(self.t, 6), **kw))
        return self

    def tr(self, rid, trigger, src, dst, row=0, gen=0):
        return self.add("transition", rid=rid, row=row, gen=gen, trigger=trigger, src=src, dst=dst)

    def chunk(self, rid, ack, start, end, row=0, gen=0, land=True, store=True):
        self.tr(rid, "offload", "PREFILLED", "OFFLOADING", row, gen)
        self.add("chunk_enqueued", rid=rid, row=row, gen=gen, ack_id=ack, start=start, end=end, pages=1)
        self.tr(rid, "enqueued", "OFFLOADING", "INFLIGHT", row, gen)
        if land:
            self.land(rid, ack, start, end, row, gen, store)
        return self

    def land(self, rid, ack, start, end, row=0, gen=0, store=True, then="PREFILLED"):
        self.add("chunk_landed", rid=rid, row=row, gen=gen, ack_id=ack, start=start, end=end, op_id=ack)
        if then:
            self.tr(rid, "landed", "INFLIGHT", then, row, gen)
        if store:
            self.add("stored", rid=rid, op_id=ack, ack_id=ack, pages=1)
        return self

    def release(self, rid, committed, row=0, gen=0, src="PREFILLED"):
        self.tr(rid, "finish", src, "FINISHED", row, gen)
        self.add("released", rid=rid, row=row, gen=gen, ranges=[[0, committed]], slots=committed,
                 committed=committed, allocated=committed)
        return self.tr(rid, "release", "FINISHED", "RELEASED", row, gen)

    def lines(self):
        return [json.dumps(e) for e in self.events]


def good():
    return Log().chunk("a", 1, 8, 12).chunk("a", 2, 12, 16).release("a", 18)


def messages(r):
    return [(v.line, v.message) for v in r.violations]


def test_declared_table_expands_sources():
    t = declared_table()
    assert t[("offload", "INFLIGHT")] == {"OFFLOADING"}
    assert t[("host_short", "OFFLOADING")] == {"PREFILLED", "INFLIGHT"}
    assert ("release", "INFLIGHT") not in t


def test_a_clean_lifecycle_passes():
    r = replay(good().lines())
    assert r.ok, messages(r)
    assert len(r.lifecycles) == 1 and len(r.chunks) == 2
    assert r.triggers["release"] == 1
    assert "OK" in format_report(r)


def test_deleted_released_event_is_named_by_line():
    lines = good().lines()
    i = next(n for n, s in enumerate(lines) if '"lifecycle.released"' in s)
    del lines[i]
    r = replay(lines)
    assert not r.ok
    assert (i + 1, "release transition without a lifecycle.released event (slots never freed)") in messages(r)


def test_duplicated_release_is_a_violation():
    lines = good().lines()
    lines.append(lines[-1])
    r = replay(lines)
    assert {line for line, _ in messages(r)} == {len(lines)}
    assert any("but the request was RELEASED" in m for _, m in messages(r))


def test_duplicated_released_event_is_a_double_free():
    lines = good().lines()
    i = next(n for n, s in enumerate(lines) if '"lifecycle.released"' in s)
    lines.insert(i, lines[i])
    r = replay(lines)
    assert any(line == i + 2 and "released 2 times" in m for line, m in messages(r))


def test_release_while_a_copy_is_in_flight():
    log = Log().chunk("a", 1, 8, 12, land=False)
    log.tr("a", "finish", "INFLIGHT", "FINISHED")
    log.add("released", rid="a", row=0, gen=0, ranges=[[0, 14]], slots=14, committed=14, allocated=14)
    log.tr("a", "release", "FINISHED", "RELEASED")
    log.land("a", 1, 8, 12, then=None)
    r = replay(log.lines())
    msgs = messages(r)
    assert any(line == 6 and "refused by the declared table" in m and "in flight: ack 1 (line 2)" in m
               for line, m in msgs), msgs
    assert any(line == 7 and "landed after the request was released" in m for line, m in msgs), msgs


def test_moving_a_release_before_its_landing_is_caught():
    log = Log().chunk("a", 1, 8, 12, land=False)
    log.tr("a", "finish", "INFLIGHT", "FINISHED")
    log.land("a", 1, 8, 12, then=None)
    log.add("released", rid="a", row=0, gen=0, ranges=[[0, 14]], slots=14, committed=14, allocated=14)
    log.tr("a", "release", "FINISHED", "RELEASED")
    lines = log.lines()
    assert replay(lines).ok
    landed = next(n for n, s in enumerate(lines) if "chunk_landed" in s)
    moved = lines[:landed] + lines[landed + 1:landed + 3] + [lines[landed]] + lines[landed + 3:]
    r = replay(moved)
    assert not r.ok and r.violations[0].line == landed + 1


def test_illegal_transition_is_named():
    lines = good().lines()
    ev = json.loads(lines[0])
    ev.update(trigger="release", src="PREFILLED", dst="RELEASED")
    lines[0] = json.dumps(ev)
    r = replay(lines)
    assert r.violations[0].line == 1
    assert "illegal transition 'release' PREFILLED -> RELEASED" in r.violations[0].message


def test_transition_from_the_wrong_state():
    log = Log().chunk("a", 1, 8, 12)
    log.tr("a", "landed", "INFLIGHT", "PREFILLED")
    r = replay(log.lines())
    assert any("but the request was PREFILLED" in m for _, m in messages(r))


def test_chunk_never_stored_or_never_landed():
    r = replay(Log().chunk("a", 1, 8, 12, store=False).release("a", 14).lines())
    assert any("never stored" in m for _, m in messages(r))
    log = Log().chunk("a", 1, 8, 12, land=False)
    r = replay(log.lines())
    assert any("never landed" in m for _, m in messages(r))
    assert any("never released" in m for _, m in messages(r))


def test_failed_storage_handoff_is_not_a_violation():
    log = Log().chunk("a", 1, 8, 12, land=False)
    log.add("chunk_landed", rid="a", row=0, gen=0, ack_id=1, error="OSError()")
    log.add("chunk_landed", rid="a", row=0, gen=0, ack_id=1, start=8, end=12, op_id=None)
    log.tr("a", "landed", "INFLIGHT", "PREFILLED")
    log.release("a", 14)
    r = replay(log.lines())
    assert r.ok, messages(r)


def test_freed_ranges_must_cover_committed_once():
    log = Log().chunk("a", 1, 8, 12)
    log.tr("a", "finish", "PREFILLED", "FINISHED")
    log.add("released", rid="a", row=0, gen=0, ranges=[[0, 8], [4, 16]], slots=20, committed=14, allocated=16)
    log.tr("a", "release", "FINISHED", "RELEASED")
    msgs = [m for _, m in messages(replay(log.lines()))]
    assert any("overlap" in m for m in msgs) and any("exactly once" in m for m in msgs)


def test_readmitted_generations_and_reused_rids():
    log = Log().chunk("a", 1, 8, 12).release("a", 14)
    log.tr("a", "readmit", "RELEASED", "PREFILLED")           # old row, generation 0
    log.chunk("a", 2, 8, 12, row=3, gen=1).release("a", 20, row=3, gen=1)
    log.chunk("a", 3, 8, 12).release("a", 14)                  # a new request object reusing rid "a", row 0
    r = replay(log.lines())
    assert r.ok, messages(r)
    assert [(x.gen, x.row) for x in r.lifecycles] == [(0, 0), (1, 3), (0, 0)]
    # a generation that appears without its readmit
    r = replay(Log().chunk("b", 1, 8, 12, row=2, gen=1).release("b", 14, row=2, gen=1).lines())
    assert any("without a readmit" in m for _, m in messages(r))


def test_two_live_requests_sharing_a_rid_on_different_rows():
    log = Log().chunk("x", 1, 8, 12, row=0, land=False).chunk("x", 2, 4, 8, row=1, land=False)
    log.land("x", 1, 8, 12, row=0).land("x", 2, 4, 8, row=1)
    log.release("x", 14, row=0).release("x", 10, row=1)
    r = replay(log.lines())
    assert r.ok, messages(r)
    assert len(r.lifecycles) == 2


def test_garbage_and_leaks_are_violations():
    r = replay(["not json", json.dumps({"event": "lifecycle.leaked", "rid": "z", "state": "INFLIGHT", "slots": 4})])
    assert [v.line for v in r.violations] == [1, 2]


# --- a real log from the simulator ------------------------------------------------------------


@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    log = d / "audit.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle_tools", "simulate", *SMALL, "--store", str(d / "store"), "--audit", str(log)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines()


def test_real_log_replays_clean(real_log):
    r = replay(real_log)
    assert r.ok, [str(v) for v in r.violations]
    assert r.triggers["release"] == len(r.lifecycles) >= 10
    assert r.triggers["readmit"] >= 1
    assert all(c.stored_line for c in r.chunks.values())


def _index(lines, pred):
    return next(i for i, s in enumerate(lines) if pred(json.loads(s)))


def test_real_log_corruptions_are_caught(real_log):
    # delete a released event
    i = _index(real_log, lambda e: e["event"] == "lifecycle.released")
    r = replay(real_log[:i] + real_log[i + 1:])
    assert not r.ok and r.violations[0].line == i + 1
    # duplicate a release transition
    j = _index(real_log, lambda e: e.get("trigger") == "release")
    r = replay(real_log[:j + 1] + [real_log[j]] + real_log[j + 1:])
    assert not r.ok and r.violations[0].line == j + 2
    # an illegal transition
    ev = json.loads(real_log[j])
    ev["src"] = "INFLIGHT"
    r = replay(real_log[:j] + [json.dumps(ev)] + real_log[j + 1:])
    assert not r.ok and r.violations[0].line == j + 1
    # move a request's release before its last landing
    events = [json.loads(s) for s in real_log]
    rel, land = next(
        (i, max(k for k in range(i) if events[k]["event"] == "lifecycle.chunk_landed"
                and events[k]["rid"] == e["rid"]))
        for i, e in enumerate(events)
        if e["event"] == "lifecycle.released"
        and any(x["event"] == "lifecycle.chunk_landed" and x["rid"] == e["rid"] for x in events[:i]))
    moved = real_log[:land] + [real_log[rel]] + real_log[land:rel] + real_log[rel + 1:]
    r = replay(moved)
    assert not r.ok and r.violations[0].line <= land + 1


def test_audit_command_exit_codes(real_log, tmp_path, capsys):
    from lifecycle_tools.cli import main

    ok = tmp_path / "ok.jsonl"
    ok.write_text("\n".join(real_log) + "\n")
    assert main(["audit", str(ok)]) == 0
    out = capsys.readouterr().out
    assert "PREFILLED" in out and "p99 ms" in out and "OK" in out
    i = _index(real_log, lambda e: e["event"] == "lifecycle.released")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(real_log[:i] + real_log[i + 1:]) + "\n")
    assert main(["audit", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"line {i + 1}:" in out and "VIOLATIONS" in out
    assert main(["audit", str(tmp_path / "missing.jsonl")]) == 2


def test_failed_and_expired_copies():
    log = Log().chunk("a", 1, 8, 12, land=False)
    log.add("copy_failed", rid="a", row=0, gen=0, ack_id=1, start=8, end=12)
    log.tr("a", "landed", "INFLIGHT", "PREFILLED")
    log.chunk("a", 2, 12, 16, land=False)
    log.add("copy_expired", rid="a", row=0, gen=0, ack_id=2, start=12, end=16, slots=4)
    log.tr("a", "landed", "INFLIGHT", "PREFILLED")
    log.release("a", 18)
    assert any("never ended" in m for _, m in messages(replay(log.lines())))
    log.add("expired_copy_ended", rid="a", ack_id=2, slots_freed=4)
    r = replay(log.lines())
    assert r.ok, messages(r)
    assert all(c.failed for c in r.chunks.values())


def _ends_without_expiry(log, ack, rid="a"):
    """``log`` plus an ``expired_copy_ended`` for ``ack``; its lines and that event's line."""
    log.add("expired_copy_ended", rid=rid, ack_id=ack, slots_freed=4)
    return log.lines(), len(log.events)


def test_an_expired_copy_end_for_a_copy_that_landed_and_was_stored_is_refused(tmp_path, capsys):
    """docs/integration.md: the end of an expired copy is accepted only for a copy the log shows
    expired. A clean log plus one such end: that line is the only violation, in the replay and in
    ``kv-lifecycle audit`` (exit 1, the line named)."""
    from lifecycle_tools.cli import main

    lines, end = _ends_without_expiry(good(), 1)
    assert messages(replay(lines)) == [(end, "expired copy ack 1 ended but never expired")]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["audit", str(path)]) == 1
    assert f"line {end}: request 'a': expired copy ack 1 ended but never expired" in capsys.readouterr().out


def test_an_expired_copy_end_for_a_copy_in_flight_a_failed_copy_or_no_copy_is_refused():
    in_flight = Log().chunk("a", 1, 8, 12, land=False)
    failed = Log().chunk("a", 1, 8, 12, land=False)
    failed.add("copy_failed", rid="a", row=0, gen=0, ack_id=1, start=8, end=12)
    for log, ack in ((in_flight, 1), (failed, 1), (good(), 7)):
        lines, end = _ends_without_expiry(log, ack)
        assert (end, f"expired copy ack {ack} ended but never expired") in messages(replay(lines))


def test_an_expired_copy_end_before_its_expiry_or_twice_is_refused():
    log = Log().chunk("a", 2, 12, 16, land=False)
    log.add("expired_copy_ended", rid="a", ack_id=2, slots_freed=4)           # line 4: before its expiry
    log.add("copy_expired", rid="a", row=0, gen=0, ack_id=2, start=12, end=16, slots=4)
    log.tr("a", "landed", "INFLIGHT", "PREFILLED")
    log.release("a", 18)
    msgs = messages(replay(log.lines()))
    assert (4, "expired copy ack 2 ended but never expired") in msgs
    assert any(line == 5 and "never ended" in m for line, m in msgs)          # the expiry is then never ended
    log.add("expired_copy_ended", rid="a", ack_id=2, slots_freed=4)
    log.add("expired_copy_ended", rid="a", ack_id=2, slots_freed=4)
    n = len(log.events)
    assert messages(replay(log.lines())) == [(4, "expired copy ack 2 ended but never expired"),
                                             (n, f"expired copy ack 2 ended twice (first on line {n - 1})")]


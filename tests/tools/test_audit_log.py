"""Reading an audit log (``lifecycle_tools.audit_log``): numeric fields range-checked, the line bound.

README / reliability.md: a bad field of an audit log is a violation on its line, never a crash, with
or without ``--timeline``; a line of up to ``MAX_LINE`` bytes is read. The held-out semantic gap on
the replay's chunk rule (consecutive chunks of a request are contiguous) is closed here too.
"""

from __future__ import annotations

import json

import pytest

from lifecycle_tools.audit_log import MAX_LINE, LogUnreadable, read_lines
from lifecycle_tools.cli import main
from lifecycle_tools.replay import replay
from tests.tools.test_replay import Log, good

HUGE = int("9" * 400)
BAD_TIMES = {"400-digit integer": HUGE, "Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan"),
             "1e308": 1e308, "negative": -5.0, "year 5200 epoch": 1e11 + 1}


def with_time(field, value, at=3):
    lines = good().lines()
    ev = json.loads(lines[at])
    ev.pop("t", None)
    ev[field] = value
    lines[at] = json.dumps(ev)              # Python's json writes Infinity / NaN and any integer
    return lines, at + 1


@pytest.mark.parametrize("field", ["t", "timestamp"])
@pytest.mark.parametrize("name", list(BAD_TIMES))
def test_a_time_that_is_not_one_is_a_violation_on_its_line(field, name):
    lines, line = with_time(field, BAD_TIMES[name])
    r = replay(lines)
    on_line = [v.message for v in r.violations if v.line == line]
    assert len(on_line) == 1 and f"field {field!r}" in on_line[0] and "not a time" in on_line[0], on_line
    assert r.t1 is not None and r.t1 < 1                  # the bad value never became the log's span


@pytest.mark.parametrize("timeline", [None, "tl.svg", "tl.mmd"])
@pytest.mark.parametrize("name", ["400-digit integer", "Infinity", "1e308"])
def test_the_audit_command_reports_a_bad_time_with_or_without_a_timeline(name, timeline, tmp_path, capsys):
    lines, line = with_time("t", BAD_TIMES[name])
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    argv = ["audit", str(path)] + (["--timeline", str(tmp_path / timeline)] if timeline else [])
    assert main(argv) == 1
    out = capsys.readouterr()
    assert f"line {line}:" in out.out and "not a time" in out.out and "Traceback" not in out.err
    assert "inf ms" not in out.out
    if timeline:
        assert (tmp_path / timeline).stat().st_size > 0


@pytest.mark.parametrize("field", ["ack_id", "start", "end", "row", "gen", "slots", "committed"])
def test_an_integer_field_past_64_bits_is_a_violation_on_its_line(field):
    log = good()
    i = next(k for k, e in enumerate(log.events) if field in e)
    log.events[i][field] = HUGE
    r = replay(log.lines())
    assert [v.line for v in r.violations if "out of range" in v.message] == [i + 1]


def test_a_time_stamp_in_iso_text_still_orders_the_log():
    lines = good().lines()
    events = [json.loads(s) for s in lines]
    for k, e in enumerate(events):
        del e["t"]
        e["timestamp"] = f"2026-12-01T18:00:{k:02d}Z"
    r = replay([json.dumps(e) for e in events])
    assert r.ok and r.t1 - r.t0 == len(events) - 1


def test_a_line_of_exactly_max_line_bytes_is_read_and_one_byte_more_is_refused(tmp_path):
    filler = '{"event": "storage.x", "pad": "'
    body = filler + "x" * (MAX_LINE - len(filler) - 2) + '"}'
    assert len(body.encode()) == MAX_LINE
    for end, after in (("\n", '{"event": "storage.y"}\n'), ("\r\n", '{"event": "storage.y"}\r\n'), ("", "")):
        path = tmp_path / "exact.jsonl"
        path.write_bytes((body + end + after).encode())   # "": the last line, no line end
        got = list(read_lines(path))
        assert len(got) == (2 if after else 1) and got[0].rstrip("\r\n") == body
    over = filler + "x" * (MAX_LINE - len(filler) - 1) + '"}'
    path = tmp_path / "over.jsonl"
    path.write_bytes(over.encode() + b"\n")
    with pytest.raises(LogUnreadable, match=f"line 1 is longer than {MAX_LINE} bytes"):
        list(read_lines(path))


def test_consecutive_chunks_that_skip_a_token_range_are_a_violation():
    """Held-out gap: the replay's contiguity rule. A chunk that starts past where the previous chunk
    of the same lifecycle ended (tokens [12, 16) never offloaded) is named on its line."""
    log = Log().chunk("a", 1, 8, 12).chunk("a", 2, 16, 20).release("a", 22)
    r = replay(log.lines())
    enq = next(k for k, e in enumerate(log.events) if e.get("ack_id") == 2) + 1
    assert [(v.line, v.message) for v in r.violations] == [
        (enq, "chunk ack 2 starts at 16, not where ack 1 ended (12)")]
    overlap = Log().chunk("a", 1, 8, 16).chunk("a", 2, 12, 20).release("a", 22)
    assert [v.message for v in replay(overlap.lines()).violations] == [
        "chunk ack 2 starts at 12, not where ack 1 ended (16)"]
    readmitted = Log().chunk("a", 1, 8, 12).release("a", 14).tr("a", "readmit", "RELEASED", "PREFILLED")
    readmitted.chunk("a", 2, 4, 8, gen=1).release("a", 10, gen=1)   # a new generation starts afresh
    assert replay(readmitted.lines()).ok

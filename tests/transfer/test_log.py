"""``transfer.log.RateLimitedLog``: per-operation warnings at most one line per event per interval,
with the occurrences not logged counted in the next line or the summary (issue 21)."""

import threading

from structlog.testing import capture_logs

from transfer.log import RateLimitedLog, get_logger


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def occurrences(lines):
    return sum(not e.get("summary") for e in lines) + sum(e.get("suppressed", 0) for e in lines)


def test_one_line_per_event_per_interval_and_every_occurrence_counted():
    clock = Clock()
    lim = RateLimitedLog(get_logger("transfer.test"), interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        for i in range(1000):
            lim.warning("x.failed", op=i)
            lim.error("y.refused", op=i)
        assert [(e["event"], e["op"], e["log_level"]) for e in logs] == [("x.failed", 0, "warning"),
                                                                        ("y.refused", 0, "error")]
        assert lim.pending() == 2 * 999
        clock.t = 10.0     # the interval passed: the next occurrence is logged, with the count before it
        lim.warning("x.failed", op=1000)
        assert logs[-1] == dict(event="x.failed", op=1000, suppressed=999, log_level="warning")
        lim.warning("x.failed", op=1001)
        lim.flush()        # the condition ended: one summary per event with occurrences not logged
    x = [e for e in logs if e["event"] == "x.failed"]
    y = [e for e in logs if e["event"] == "y.refused"]
    assert len(x) == 3 and x[-1] == dict(event="x.failed", op=1001, suppressed=1, summary=True, log_level="warning")
    assert len(y) == 2 and y[-1] == dict(event="y.refused", op=999, suppressed=999, summary=True, log_level="error")
    assert occurrences(x) == 1002 and occurrences(y) == 1000 and lim.pending() == 0


def test_flush_with_nothing_suppressed_writes_nothing_and_starts_afresh():
    lim = RateLimitedLog(get_logger("transfer.test"), interval_s=3600.0, clock=Clock())
    with capture_logs() as logs:
        lim.warning("x.failed", op=1)
        lim.flush()
        lim.warning("x.failed", op=2)   # a new outage: its first occurrence is logged at once
    assert [e["op"] for e in logs] == [1, 2] and not any("suppressed" in e for e in logs)


def test_counts_are_exact_from_many_threads():
    lim = RateLimitedLog(get_logger("transfer.test"), interval_s=3600.0)
    with capture_logs() as logs:
        threads = [threading.Thread(target=lambda: [lim.warning("x.failed") for _ in range(500)]) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lim.flush()
    assert len(logs) == 2 and occurrences(logs) == 4000

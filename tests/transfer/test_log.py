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


# -- where an event goes: structlog when configured, else the stdlib logger of that name -------
import logging  # noqa: E402

import pytest  # noqa: E402
import structlog  # noqa: E402
from structlog.testing import LogCapture  # noqa: E402

import transfer.log as tlog  # noqa: E402


@pytest.fixture
def structlog_restored():
    """Lets a test (re)configure structlog; the previous configuration comes back afterwards."""
    saved, was = structlog.get_config(), structlog.is_configured()
    yield
    structlog.reset_defaults()
    if was:
        structlog.configure(**saved)


def test_unconfigured_events_go_to_the_stdlib_logger_of_that_name(structlog_restored, caplog):
    structlog.reset_defaults()
    log = tlog.get_logger("transfer.t_log", req=7)
    with caplog.at_level(logging.INFO, logger="transfer.t_log"):
        log.info("x.happened", n=1)
        log.bind(op=2).warning("y.failed")
        log.debug("z.hidden")               # below the logger's level: not emitted
        assert log.is_enabled_for(logging.INFO) and not log.is_enabled_for(logging.DEBUG)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("transfer.t_log", logging.INFO, "x.happened req=7 n=1"),
        ("transfer.t_log", logging.WARNING, "y.failed req=7 op=2"),
    ]
    assert [r.event_dict for r in caplog.records] == [{"event": "x.happened", "req": 7, "n": 1},
                                                      {"event": "y.failed", "req": 7, "op": 2}]
    plain = tlog.get_logger("transfer.t_log")
    with caplog.at_level(logging.INFO, logger="transfer.t_log"):
        plain.info("w.plain")
    assert caplog.records[-1].event_dict == {"event": "w.plain"}


def test_configured_structlog_gets_the_logger_name_and_context(structlog_restored):
    names, cap = [], LogCapture()

    class Factory:
        def __call__(self, *args):
            names.append(args)
            return structlog.PrintLogger()

    structlog.configure(processors=[cap], logger_factory=Factory())
    tlog.get_logger("transfer.named", req=3).warning("e.x", n=1)
    assert names == [("transfer.named",)]
    assert cap.entries == [dict(event="e.x", req=3, n=1, log_level="warning")]


def warning_filter_applies():
    """Configure structlog with a WARNING filtering wrapper and check a transfer logger obeys it,
    level inclusive; return the logger and the capture."""
    cap = LogCapture()
    structlog.configure(processors=[cap], wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    log = tlog.get_logger("transfer.t_log")
    log.info("a.info")
    log.warning("b.warning")
    assert [e["event"] for e in cap.entries] == ["b.warning"]
    assert log.is_enabled_for(logging.WARNING) and not log.is_enabled_for(logging.INFO)
    return log, cap


def test_a_filtering_wrapper_level_is_inclusive(structlog_restored):
    warning_filter_applies()


class _NoLevelTest(structlog.BoundLoggerBase):
    """A custom wrapper class (not one of structlog's filtering ones) without a level test."""

    def warning(self, event, **kw):
        return self._proxy_to_logger("warning", event, **kw)

    def error(self, event, **kw):
        return self._proxy_to_logger("error", event, **kw)


class _ErrorsOnly(_NoLevelTest):
    """A custom wrapper class with its own level test."""

    def is_enabled_for(self, level):
        return level >= logging.ERROR


def test_a_custom_wrapper_decides_by_its_is_enabled_for(structlog_restored):
    cap = LogCapture()
    structlog.configure(processors=[cap], wrapper_class=_ErrorsOnly)
    log = tlog.get_logger("transfer.t_log")
    log.warning("a.warning")
    log.error("b.error")
    assert [e["event"] for e in cap.entries] == ["b.error"]
    assert log.is_enabled_for(logging.ERROR) and not log.is_enabled_for(logging.WARNING)


def test_a_custom_wrapper_without_a_level_test_gets_every_event(structlog_restored):
    cap = LogCapture()
    structlog.configure(processors=[cap], wrapper_class=_NoLevelTest)
    log = tlog.get_logger("transfer.t_log")
    log.warning("a.warning")
    assert [e["event"] for e in cap.entries] == ["a.warning"]
    assert log.is_enabled_for(logging.DEBUG)


def test_without_structlogs_config_object_the_public_api_decides(structlog_restored, monkeypatch, caplog):
    """``_CONFIG`` is structlog's private configuration object; a structlog without it is asked
    through ``structlog.is_configured`` / ``get_config``, with the same outcome."""
    monkeypatch.setattr(tlog, "_CONFIG", None)
    log, cap = warning_filter_applies()
    structlog.reset_defaults()
    with caplog.at_level(logging.INFO, logger="transfer.t_log"):
        log.info("c.info")
    assert [r.event_dict["event"] for r in caplog.records] == ["c.info"]
    assert not cap.entries[1:]


def test_demote_logs_the_suppressed_occurrences_at_debug_with_their_fields():
    clock = Clock()
    lim = RateLimitedLog(get_logger("transfer.test"), interval_s=10.0, clock=clock, demote=True)
    with capture_logs() as logs:
        for i in range(3):
            lim.warning("x.failed", op=i)
    assert logs == [dict(event="x.failed", op=0, log_level="warning"),
                    dict(event="x.failed", op=1, log_level="debug"),
                    dict(event="x.failed", op=2, log_level="debug")]
    assert lim.pending() == 2

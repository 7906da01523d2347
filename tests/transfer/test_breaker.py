"""The circuit breaker's states, backoff and once-per-outage logging (injected clock)."""

import pytest
from structlog.testing import capture_logs

from transfer.storage.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_opens_on_failure_rejects_then_probes_after_backoff_and_closes_on_success():
    clock = Clock()
    b = CircuitBreaker("redis://x", base_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    assert b.allow() and b.state is BreakerState.CLOSED
    with capture_logs() as logs:
        b.failure(ConnectionError("refused"))
        assert b.state is BreakerState.OPEN
        assert [b.allow() for _ in range(5)] == [False] * 5
        clock.t += 1.0
        assert b.allow() and b.state is BreakerState.HALF_OPEN
        assert b.allow()  # re-entrant: a guarded call inside a guarded call is let through
        b.failure("still down")  # the probe failed: backoff doubles
        assert b.state is BreakerState.OPEN and b.retry_in() == pytest.approx(2.0)
        clock.t += 1.9
        assert not b.allow()
        clock.t += 0.1
        assert b.allow()
        b.failure("down")
        assert b.retry_in() == pytest.approx(4.0)
        clock.t += 4
        assert b.allow()
        b.failure("down")
        assert b.retry_in() == pytest.approx(4.0)  # capped
        clock.t += 4
        assert b.allow()
        b.success()
    assert b.state is BreakerState.CLOSED
    events = [e["event"] for e in logs]
    assert events.count("storage.tier_down") == 1 and events.count("storage.tier_recovered") == 1
    st = b.stats()
    assert (st.outages, st.rejected, st.probes, st.state) == (1, 6, 4, "closed")
    b.failure("again")  # a new outage starts again from the base backoff
    assert b.retry_in() == pytest.approx(1.0) and b.stats().outages == 2


def test_late_failure_while_open_does_not_extend_the_outage():
    clock = Clock()
    b = CircuitBreaker(base_backoff_s=1.0, clock=clock)
    b.failure("timeout")
    clock.t += 0.5
    b.failure("the same call's late error")
    assert b.retry_in() == pytest.approx(0.5)


def test_a_late_success_while_open_does_not_end_the_outage():
    """A call made before the breaker opened may answer after it did (a loaded node, a write that was
    already on the wire): the tier is still down, so the breaker stays open, and the next failures
    are the same outage — one ``storage.tier_down``, not two."""
    clock = Clock()
    b = CircuitBreaker("redis://x", base_backoff_s=1.0, clock=clock)
    with capture_logs() as logs:
        b.failure("refused")
        b.success()                              # the late answer of a call made before the outage
        assert b.state is BreakerState.OPEN and not b.allow()
        assert b.retry_in() == pytest.approx(1.0)
        b.failure("refused")
        clock.t += 1.0
        assert b.allow() and b.state is BreakerState.HALF_OPEN
        b.success()                              # a probe answered: the outage ends
    assert b.state is BreakerState.CLOSED
    events = [e["event"] for e in logs]
    assert events.count("storage.tier_down") == 1 and events.count("storage.tier_recovered") == 1
    assert b.stats().outages == 1 and b.stats().successes == 2


def test_threshold_counts_consecutive_failures_only():
    b = CircuitBreaker(failure_threshold=3, clock=Clock())
    b.failure("x")
    b.failure("x")
    b.success()
    b.failure("x")
    b.failure("x")
    assert b.state is BreakerState.CLOSED
    b.failure("x")
    assert b.state is BreakerState.OPEN


@pytest.mark.parametrize("kw", [{"failure_threshold": 0}, {"base_backoff_s": 0},
                                {"base_backoff_s": 2, "max_backoff_s": 1}])
def test_bad_settings_rejected(kw):
    with pytest.raises(ValueError):
        CircuitBreaker(**kw)


@pytest.mark.parametrize("error, logged", [
    (None, None),
    (ConnectionError("Connection  refused\n by peer"), "Connection refused by peer"),  # one line, single spaces
    (TimeoutError(), "TimeoutError"),  # no text: the error's type
    ("lookup took longer than 0.05s", "lookup took longer than 0.05s"),
])
def test_the_outage_is_logged_with_the_tier_its_first_backoff_and_the_error(error, logged):
    b = CircuitBreaker("redis://h:1/0", base_backoff_s=0.25, clock=Clock())
    assert b.retry_in() == 0.0  # closed: nothing to wait for
    with capture_logs() as logs:
        b.failure(error)
        b.failure(error)  # already open: counted, not logged again
    (ev,) = logs
    assert ev["event"] == "storage.tier_down" and ev["log_level"] == "warning"
    assert ev["tier"] == "redis://h:1/0" and ev["retry_in_s"] == 0.25 and ev["error"] == logged
    assert b.stats().failures == 2 and b.retry_in() == 0.25

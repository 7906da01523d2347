"""Call discipline shared by every ``DecodeOffloadManager`` call: one call at a time (re-entry is
refused with ``ReentrantCall`` before anything changes), no call after ``shutdown``
(``ManagerClosed``), refusals raised and logged the same way, and audit events emitted once the
call's state is consistent (a log processor that calls back into the manager finds it idle)."""

from __future__ import annotations

import functools
import logging
import math
import time

from lifecycle import audit, machine, settle
from lifecycle.errors import InvalidArgument, InvalidTransition, LifecycleError, ManagerClosed, ReentrantCall
from lifecycle.records import Record
from lifecycle.states import Facts, Refusal

BUSY, CLOSED = "busy", "closed"
# per-operation alerts: one per chunk, copy or request, so a failing device or tier repeats them
PER_OP_ALERTS = frozenset((audit.COPY_FAILED, audit.CHUNK_LANDED, audit.COPY_EXPIRED, audit.EXPIRED_COPY_ENDED,
                           audit.HOST_SHORT, audit.LEAKED, audit.REFUSED, audit.BAD_RELEASE_ROW,
                           audit.RELEASE_CHECKS_UNREAD))
_ALERT_LEVELS = {"warning": logging.WARNING, "error": logging.ERROR}
HOST_SHORT_WARN_S = 60.0  # at most one host-pool-short warning per this many seconds


class CallGate:
    """Mixin of ``DecodeOffloadManager``: ``_gate`` (None, ``BUSY`` or ``CLOSED``), ``_logs`` (the
    current call's audit events), ``_log`` and ``_debug`` are set by the manager."""

    def _enter(self) -> None:
        if self._gate is not None:
            self._refuse_gate()
        self._gate = BUSY
        self._debug = self._log.is_enabled_for(logging.DEBUG)

    def _close_gate(self) -> None:
        """``shutdown``: no call is accepted from now on (``ManagerClosed``)."""
        self._gate = CLOSED

    def _leave(self) -> None:
        self._gate = None
        if self._logs:
            logs, self._logs = self._logs, []
            for method, event, fields in logs:
                method(event, **fields)

    def _emit(self, method, event: str, **fields) -> None:
        """Log ``event`` once the current call's state is consistent (at once outside a call).

        A per-operation warning or error (``PER_OP_ALERTS``) goes through the manager's
        ``RateLimitedLog`` (``_alerts``): at its level at most once per event per interval (with
        ``suppressed=N``), at DEBUG otherwise, so the audit trail keeps every event and a console
        gets bounded lines when copies keep failing."""
        level = _ALERT_LEVELS.get(getattr(method, "__name__", ""))
        if level is not None and event in PER_OP_ALERTS:
            method = functools.partial(self._alerts.log_via, method.__self__, level)
        if self._gate is BUSY:
            self._logs.append((method, event, fields))
        else:
            method(event, **fields)

    def _refuse_gate(self):
        if self._gate == CLOSED:
            raise ManagerClosed("the manager was shut down")
        raise ReentrantCall("a DecodeOffloadManager call was made while another call of the same manager "
                            "is running (from a log processor or a callback?); nothing was changed")

    def _raise(self, rid, trigger: str, state: str, reason: str):
        self._ledger.count_refusal(trigger, state)  # bounded: triggers x states (+ UNSEEN)
        self._emit(self._log.info, audit.REFUSED, rid=rid, trigger=trigger, state=state, reason=reason)
        raise InvalidTransition(rid, trigger, state, reason)

    def _refuse(self, rec: Record, trigger: str, facts: Facts):
        verdict = machine.EVENTS[trigger].choose(facts)
        reason = verdict.explain(facts) if isinstance(verdict, Refusal) else f"{trigger!r} not allowed"
        if self._gate is None:  # the fast path logs at once
            self._ledger.count_refusal(trigger, rec.state.name)
            self._log.info(audit.REFUSED, rid=rec.rid, trigger=trigger, state=rec.state.name, reason=reason)
            raise InvalidTransition(rec.rid, trigger, rec.state.name, reason)
        self._raise(rec.rid, trigger, rec.state.name, reason)

    def _note_host_short(self, rec: Record, start: int, end: int) -> None:
        """Counted; each refusal is an audit event (INFO); a WARNING at most every ``HOST_SHORT_WARN_S``."""
        self._emit(rec.log.info, audit.HOST_SHORT, start=start, end=end)
        refused = self._ledger.note_host_short(self._clock(), HOST_SHORT_WARN_S)
        if refused is not None:
            self._emit(self._log.warning, audit.HOST_SHORT_SUMMARY, refused=refused,
                       total=self._ledger.host_short, interval_s=HOST_SHORT_WARN_S)


def shutdown(mgr, force: bool, timeout_s: float):
    """``DecodeOffloadManager.shutdown``: refuse or abandon what is pending, close in bounded time:
    ``timeout_s`` bounds the whole call (the drain, then the offloader's close with what is left).
    The arguments are checked first: a bad one raises ``InvalidArgument`` with the manager open and
    the offloader untouched, so a corrected call works."""
    if not isinstance(force, bool):
        raise InvalidArgument(f"shutdown: force must be True or False, got {force!r}; nothing was closed")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not 0 <= timeout_s < math.inf):
        raise InvalidArgument(
            f"shutdown: timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}; nothing was closed")
    # one bound for the whole call: the drain and the offloader's close share it (the close gets
    # what the drain left, not the bound again)
    deadline = time.monotonic() + timeout_s
    if mgr._gate == CLOSED:
        return mgr._ledger.pending()
    if force and mgr._gate is None:
        drain(mgr, timeout_s)
    mgr._enter()
    try:
        settle.collect(mgr)
        ledger = mgr._ledger
        pending = ledger.pending()
        busy = not ledger.idle()
        if busy and not force:
            raise LifecycleError(f"shutdown refused: {pending.describe()}")
        if ledger.release_checks:  # device-side release checks: the landed ones read, the rest dropped
            settle.release_checks(mgr, final=True)
        if busy:
            ledger.abandon(pending.copies + pending.storage_ops)
            mgr._emit(mgr._log.error, audit.ABANDONED, pending=pending.describe(),
                      acks=sorted(ledger.ongoing),
                      copies=[(c.rec.rid, ack, c.start, c.end) for ack, c in ledger.ongoing.items()],
                      held_slots=sum(c.indices.shape[0] for c in ledger.ongoing.values()),
                      quarantined_slots=pending.quarantined_slots,
                      why="a copy may still read these slots: they stay allocated, never reused")
    finally:
        mgr._leave()
    mgr._close_gate()
    report = mgr.offloader.close(max(0.0, deadline - time.monotonic()))  # the protocol's close(timeout)
    if getattr(report, "clean", True) is False:  # a CloseReport (HostOffloader), None, or anything
        mgr._log.error(audit.ABANDONED, pending=str(report))
    return pending


DRAIN_POLL_S = 0.001


def drain(mgr, timeout_s: float | None) -> bool:
    """``shutdown(force=True)``'s first step: settle landed copies, submit their storage writes and
    wait for those, releasing finished requests, until nothing is in flight or ``timeout_s``
    seconds have passed (None: no bound). With a ``tp_group`` every rank runs the same number of
    progress checks: each round ends with one agreement (MAX) on "still busy" and "bound reached".

    Returns:
        True when the manager is idle. A progress check that raises ends the drain (logged once as
        ``lifecycle.drain_stopped``); what is still pending is then abandoned by ``shutdown``.
    """
    deadline = None if timeout_s is None else time.monotonic() + max(0.0, float(timeout_s))
    while True:
        try:
            mgr.check_offload_progress()
        except Exception as err:  # noqa: BLE001 (shutdown never raises for pending work)
            mgr._log.error(audit.DRAIN_STOPPED, error=repr(err))
            return mgr.idle()
        busy = not mgr.idle()
        expired = deadline is not None and time.monotonic() >= deadline
        if mgr.tp_group is not None:
            busy, expired = _agree_busy(mgr, busy, expired)
        if not busy or expired:
            return not busy
        time.sleep(DRAIN_POLL_S)


def _agree_busy(mgr, busy: bool, expired: bool) -> tuple[bool, bool]:
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(busy), int(expired)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mgr.tp_group)
    return bool(flags[0]), bool(flags[1])

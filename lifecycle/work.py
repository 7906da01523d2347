"""The work the lifecycle's transitions do, bound by name to the table in ``lifecycle.states``.

``lifecycle.machine`` binds each name of ``CALLBACKS`` where the table lists it (``before``/
``after``); the machine calls it with the event data: ``fire.model`` is the request's ``Record``,
``fire.kwargs`` what the manager passed to the trigger (always ``mgr``, the manager, and ``req``).
Every input was planned and validated by the caller (``lifecycle.requests``) before the trigger was
fired, so nothing here can fail for a reason the plan could have seen; a collaborator (offloader,
pools) may still raise, and then the transition's effects are undone or never applied.
"""

from __future__ import annotations

from logging import DEBUG

from lifecycle import audit, machine, settle


def enqueue_chunk(fire) -> None:
    """After ``offload``: hand the planned chunk to the offloader; fire ``enqueued`` or ``host_short``.

    The offloader raising (or returning None: host memory short) fires ``host_short``, which
    returns the request to the state it was in; nothing advanced. The error then propagates.
    """
    mgr, kw, rec = fire.kwargs["mgr"], fire.kwargs, fire.model
    chunk = kw["chunk"]
    ack = mgr._ledger.next_ack()
    try:
        host = mgr.offloader.write(chunk.indices, ack)
    except BaseException as err:
        machine.host_short(rec, mgr=mgr, req=kw["req"], start=chunk.start, end=chunk.end, error=err)
        raise
    if host is None:
        machine.host_short(rec, mgr=mgr, req=kw["req"], start=chunk.start, end=chunk.end)
        return
    chunk.ack_id, chunk.host, chunk.enqueued_at = ack, host, mgr._clock()
    machine.enqueued(rec, mgr=mgr, req=kw["req"], chunk=chunk)


def commit_chunk(fire) -> None:
    """Before ``enqueued``: record the chunk in flight (its slots counted as read) and advance
    ``inc_len`` and ``last_hash``."""
    mgr, rec, chunk = fire.kwargs["mgr"], fire.model, fire.kwargs["chunk"]
    mgr._ledger.commit(rec, chunk)
    if mgr._debug:
        mgr._emit(
            rec.log.debug, audit.CHUNK_ENQUEUED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end,
            pages=len(chunk.page_hashes), first_hash=chunk.page_hashes[0], last_hash=chunk.page_hashes[-1],
        )


def count_host_short(fire) -> None:
    """After ``host_short``: count and log the refused (or failed) enqueue; nothing advanced."""
    mgr, rec, kw = fire.kwargs["mgr"], fire.model, fire.kwargs
    error = kw.get("error")
    if error is None:
        mgr._note_host_short(rec, kw["start"], kw["end"])
    else:
        mgr._emit(rec.log.error, audit.HOST_SHORT, start=kw["start"], end=kw["end"], error=repr(error))


def free_memory(fire) -> None:
    """Before ``release``: execute the validated ``ReleasePlan`` through the release sink (all
    slots, minus quarantined ones, and the row, in one call), then account for it (a device row's
    device-side check is queued for a later progress check: ``settle.release_checks``)."""
    mgr, rec, plan = fire.kwargs["mgr"], fire.model, fire.kwargs["plan"]
    freed = mgr.release_sink.free(plan)
    if plan.device_check is not None:  # a device row: its verdict is read by a later progress check
        settle.queue_release_check(mgr, plan.device_check)
    mgr._ledger.released_rec(rec, freed)  # False: the sink freed nothing (another owner frees the quarantined)
    if mgr._log.is_enabled_for(DEBUG):   # per request: DEBUG, so a server at INFO logs nothing per request
        mgr._emit(rec.log.debug, audit.RELEASED, ranges=list(plan.ranges), slots=sum(e - s for s, e in plan.ranges),
                  committed=plan.committed, allocated=plan.allocated, quarantined=plan.quarantined)


def reset_progress(fire) -> None:
    """After ``readmit``: a new lifecycle on the new row, with fresh offload progress."""
    kw = fire.kwargs
    kw["mgr"]._ledger.restart(fire.model, kw["view"], kw["progress"])  # ``rec.log`` binds the new row and generation


def record_transition(fire) -> None:
    """Machine-wide, before every state change: per-state counters and the audit event."""
    mgr, rec, t = fire.kwargs["mgr"], fire.model, fire.transition
    mgr._ledger.transition(t.source, t.dest, fire.event.name)
    if mgr._debug:
        mgr._emit(rec.log.debug, audit.TRANSITION, trigger=fire.event.name, src=t.source, dst=t.dest)


CALLBACKS = {f.__name__: f for f in (enqueue_chunk, commit_chunk, count_host_short, free_memory, reset_progress)}

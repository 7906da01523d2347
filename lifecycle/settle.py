"""Completion settling: copies landed, failed or expired, storage ops finished, quarantine, and
TP agreement. Runs inside ``DecodeOffloadManager.check_offload_progress``."""

from __future__ import annotations

import torch

from lifecycle import audit
from lifecycle.errors import LifecycleError, UnknownCompletion
from lifecycle.records import Chunk, Quarantine, ReleaseCheck, StorageOp
from lifecycle.states import State
from transfer.gather import ids_verdict

_INFLIGHT, _FINISHED = State.INFLIGHT, State.FINISHED


def poll(mgr) -> list:
    """Collect what the offloader reports (expired, landed, failed, stored) without settling
    landings or storage ops; expired copies are quarantined at once. Returns the refusals of
    releases attempted on the way (see ``after_copy``)."""
    refused = []
    if mgr._poll_expired is not None:
        for ack in mgr._poll_expired():
            chunk = mgr._ongoing.pop(ack, None)
            err = on_expired(mgr, chunk) if chunk is not None else None
            if err is not None:
                refused.append(err)
    mgr._landed.update(mgr.offloader.finished_writes())
    if mgr._poll_failed is not None:  # a subset of what finished_writes just reported
        mgr._failed.update(mgr._poll_failed())
    mgr._stored.update(mgr.offloader.finished_storage())
    return refused


def collect(mgr) -> None:
    """Move the landings, failures and finished storage ops the offloader reports into the
    manager's unsettled sets (``stats().unsettled``); settles nothing (``poll`` without expiry)."""
    mgr._landed.update(mgr.offloader.finished_writes())
    if mgr._poll_failed is not None:  # a subset of what finished_writes just reported
        mgr._failed.update(mgr._poll_failed())
    mgr._stored.update(mgr.offloader.finished_storage())


def progress(mgr) -> None:
    """Settle every completion reported (with a TP group: the prefix all ranks agree on).

    Raises:
        UnknownCompletion: the offloader reported an id never issued (after settling the rest).
        LifecycleError: the release of a finished request whose last copy landed was refused
            (after settling the rest; the request stays FINISHED for a retry).
    """
    refused = poll(mgr)
    landed, stored = mgr._landed, mgr._stored
    if mgr._expired:
        for ack in [a for a in landed if a in mgr._expired]:
            landed.discard(ack)
            mgr._failed.discard(ack)
            on_expired_ended(mgr, mgr._expired.pop(ack))
    unknown = ()  # one C-level subset test each on the common path (every id known)
    if not mgr._ongoing.keys() >= landed or not mgr._storage_ops.keys() >= stored:
        unknown = [("ack", a) for a in landed if a not in mgr._ongoing]
        unknown += [("op", o) for o in stored if o not in mgr._storage_ops]
        for kind, i in unknown:
            (landed if kind == "ack" else stored).discard(i)
    if mgr.tp_group is None:  # landings in issue order: a chain's chunks reach storage (and KV events) in order
        acks, ops = [a for a in mgr._ongoing if a in landed], list(stored)
    else:
        acks, ops = done_prefix(mgr._ongoing, landed), done_prefix(mgr._storage_ops, stored)
        n_writes, n_stored = agree(mgr, len(acks), len(ops))
        acks, ops = acks[:n_writes], ops[:n_stored]
    for ack in acks:
        landed.discard(ack)
        err = on_landed(mgr, mgr._ongoing.pop(ack))
        if err is not None:
            refused.append(err)
    for op_id in ops:
        stored.discard(op_id)
        on_stored(mgr, mgr._storage_ops.pop(op_id))
    if unknown:
        raise UnknownCompletion(f"offloader reported ids never issued or already settled: {unknown}")
    if refused:
        raise refused[0]


def on_landed(mgr, chunk: Chunk):
    """A copy landed: store its pages (or drop them: a failed copy), then move the request on."""
    rec = chunk.rec
    rec.inflight -= 1
    mgr._reading.remove(chunk.ack_id)
    mgr._chunks_landed += 1
    if chunk.ack_id in mgr._failed:
        mgr._failed.discard(chunk.ack_id)
        mgr._copy_failures += 1
        mgr._emit(rec.log.error, audit.COPY_FAILED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end)
        mgr.offloader.free_host(chunk.host)
        return after_copy(mgr, rec, chunk.req)
    op_id = None
    try:
        if mgr._store_parent:
            op_id = mgr.offloader.write_storage(chunk.host, chunk.tokens, chunk.page_hashes, chunk.parent_hash)
        else:
            op_id = mgr.offloader.write_storage(chunk.host, chunk.tokens, chunk.page_hashes)
    except Exception as err:
        mgr._emit(rec.log.error, audit.CHUNK_LANDED, ack_id=chunk.ack_id, error=repr(err))
        mgr.offloader.free_host(chunk.host)
    else:
        mgr._storage_ops[op_id] = StorageOp(
            op_id, rec.rid, chunk.ack_id, chunk.host, len(chunk.page_hashes),
            chunk.page_hashes[0], chunk.page_hashes[-1],
        )
    if mgr._debug:
        mgr._emit(
            rec.log.debug, audit.CHUNK_LANDED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end, op_id=op_id,
            latency_s=round(mgr._clock() - chunk.enqueued_at, 6),
        )
    return after_copy(mgr, rec, chunk.req)


def after_copy(mgr, rec, req):
    """A copy of the request is no longer in flight: move on when it was the last. Returns the
    refusal of the release it attempted, if any (the request then stays FINISHED), else None."""
    if rec.inflight:
        return None
    if rec.state is _INFLIGHT:
        mgr._fire["landed"](rec, mgr=mgr, req=req)
        if not req.finished():
            return None
    elif rec.state is not _FINISHED:
        return None
    try:
        mgr._release(rec, req)
    except LifecycleError as err:
        mgr._emit(rec.log.error, audit.REFUSED, trigger="release", state=rec.state.name, reason=str(err))
        return err
    return None


def on_expired(mgr, chunk: Chunk):
    """A copy passed its deadline: stop waiting for it, but quarantine the slots it may read."""
    rec = chunk.rec
    rec.inflight -= 1
    mgr._copies_expired += 1
    slots = chunk.indices
    mgr._expired[chunk.ack_id] = Quarantine(chunk.ack_id, rec.rid, chunk.host, slots)
    rec.expired = (rec.expired or ()) + (chunk.ack_id,)
    mgr._emit(rec.log.error, audit.COPY_EXPIRED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end,
              slots=slots.numel())
    return after_copy(mgr, rec, chunk.req)


def on_expired_ended(mgr, q: Quarantine) -> None:
    """An expired copy finally ended: its host pages, and its slots if already released, go back."""
    mgr.offloader.free_host(q.host)
    mgr._reading.remove(q.ack_id)
    if q.released:
        mgr.token_to_kv_pool_allocator.free(q.slots)
    mgr._emit(mgr._log.warning, audit.EXPIRED_COPY_ENDED, rid=q.rid, ack_id=q.ack_id,
              slots_freed=q.slots.numel() if q.released else 0)


def on_stored(mgr, op: StorageOp) -> None:
    """A storage op finished (either way): its host pages go back."""
    mgr.offloader.free_host(op.host)
    mgr._storage_finished += 1
    if mgr._debug:
        mgr._emit(mgr._log.debug, audit.STORED, rid=op.rid, op_id=op.op_id, ack_id=op.ack_id, pages=op.pages,
                  first_hash=op.first_hash, last_hash=op.last_hash)


MAX_RELEASE_CHECKS = 1024  # device-side release checks kept unread (a scheduler that never polls)


def queue_release_check(mgr, check: ReleaseCheck) -> None:
    """A device row was released: keep its device-side check until a progress check reads it.

    Bounded: past ``MAX_RELEASE_CHECKS`` unread (progress checks not called), the landed ones are
    read now and, if still too many, the oldest are dropped unread (``lifecycle.release_checks_unread``).
    """
    checks = mgr._release_checks
    checks.append(check)
    if len(checks) > MAX_RELEASE_CHECKS:
        release_checks(mgr)
        if len(checks) > MAX_RELEASE_CHECKS:
            drop = len(checks) - MAX_RELEASE_CHECKS
            for _ in range(drop):
                checks.popleft()
            mgr._emit(mgr._log.warning, audit.RELEASE_CHECKS_UNREAD, unread=drop,
                      why=f"more than {MAX_RELEASE_CHECKS} released device rows not yet checked: "
                          f"is check_offload_progress called?")


def release_checks(mgr, final: bool = False) -> None:
    """Read the device-side checks of released device rows whose verdict has landed (the event
    queried, never waited for; off CUDA at once) and report the bad ones: counted
    (``stats().bad_release_rows``) and logged at ERROR (``lifecycle.bad_release_row``, rate-limited)
    naming the request, its row, the ranges and what was wrong. Not refused: the release was
    executed before the device could answer. Checks not landed yet stay for a later call; with
    ``final`` (shutdown) they are dropped unread and their number logged."""
    checks = mgr._release_checks
    for _ in range(len(checks)):
        c = checks.popleft()
        if c.event is not None and not c.event.query():
            checks.append(c)  # not landed yet: read by a later call (order kept)
            continue
        found = ids_verdict(c.verdict)
        if found is not None:
            mgr._bad_release_rows += 1
            log = mgr._log.bind(rid=c.rid, row=c.row, gen=c.gen)
            mgr._emit(log.error, audit.BAD_RELEASE_ROW, ranges=[tuple(r) for r in c.ranges],
                      problem=_bad_row(found, mgr._slot_end), slots_end=mgr._slot_end, **found,
                      why="checked on the device after the release was issued: reported, not refused")
    if final and checks:
        mgr._emit(mgr._log.warning, audit.RELEASE_CHECKS_UNREAD, unread=len(checks),
                  why="shutdown: their verdict had not landed")
        checks.clear()


def _bad_row(found: dict, end) -> str:
    """What a device-side release check found, in words."""
    parts = []
    if found["negative"]:
        parts.append(f"{found['negative']} negative slot ids (smallest {found['min']}; -1: KV never allocated there)")
    if found["out_of_range"]:
        parts.append(f"{found['out_of_range']} slot ids at or past the pool's {end} slots (largest {found['max']})")
    if found["repeated"]:
        parts.append(f"{found['repeated']} slot ids listed more than once (e.g. {found['repeated_id']}; "
                     f"a cleared or overwritten row)")
    return "; ".join(parts)


def agree(mgr, n_writes: int, n_stored: int) -> tuple[int, int]:
    """MIN across the TP group of how many copies and storage ops to settle."""
    import torch.distributed as dist

    counts = torch.tensor([n_writes, n_stored], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=mgr.tp_group)
    return int(counts[0]), int(counts[1])


def done_prefix(table: dict, done: set) -> list:
    """Keys of ``table`` (in issue order) up to the first one not in ``done``."""
    prefix = []
    for key in table:
        if key not in done:
            break
        prefix.append(key)
    return prefix

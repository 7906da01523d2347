"""Completion settling, one completion at a time: a copy landed (its storage write submitted, or
its pages dropped when it failed), a copy expired (quarantined) or finally ended, a storage op
finished, a released device row's check read. Each function takes the manager's parts it needs,
changes the ledger only through its methods and emits the audit events; none of them moves a
request through the machine: ``DecodeOffloadManager.check_offload_progress`` does that, with the
records these functions hand back."""

from __future__ import annotations

import torch

from lifecycle import audit
from lifecycle.ledger import Ledger
from lifecycle.records import Chunk, Quarantine, StorageOp


def expired(mgr, ack: int) -> Chunk | None:
    """A copy passed its deadline: stop waiting for it, but quarantine the slots it may read.
    Returns its chunk (its request has one copy fewer in flight), None for an ack not in flight."""
    chunk = mgr._ledger.expire(ack)
    if chunk is not None:
        mgr._emit(chunk.rec.log.error, audit.COPY_EXPIRED, ack_id=ack, start=chunk.start, end=chunk.end,
                  slots=chunk.indices.shape[0])
    return chunk


def collect(mgr) -> None:
    """Move what the offloader reports (one ``finished_writes`` poll: landed / failed / expired
    copies; the finished storage ops) into the ledger's unsettled sets (``stats().unsettled``;
    the expiries wait for the next progress check); settles nothing."""
    off = mgr.offloader
    report = off.finished_writes()
    failed = report.failed
    ended = report.landed + failed if failed else report.landed  # the ledger's failed: a subset of ended
    mgr._ledger.collect(ended, failed, off.finished_storage(), report.expired)


def _free_host(mgr, host, errors: list) -> None:
    """Hand host pages back; an offloader that raises is noted in ``errors`` (settling goes on)."""
    try:
        mgr.offloader.free_host(host)
    except Exception as err:
        errors.append(err)


def landed(mgr, ack: int, errors: list) -> Chunk:
    """A copy landed: store its pages (or drop them: a failed copy). Returns its chunk; the
    ledger has settled it even when the offloader raised (noted in ``errors``)."""
    chunk, failed = mgr._ledger.land(ack)
    rec = chunk.rec
    if failed:
        mgr._emit(rec.log.error, audit.COPY_FAILED, ack_id=ack, start=chunk.start, end=chunk.end)
        _free_host(mgr, chunk.host, errors)
        return chunk
    op_id = None
    try:
        op_id = mgr.offloader.write_storage(chunk.host, chunk.tokens, chunk.page_hashes, chunk.parent_hash)
    except Exception as err:
        mgr._emit(rec.log.error, audit.CHUNK_LANDED, ack_id=ack, error=repr(err))
        _free_host(mgr, chunk.host, errors)
    else:
        mgr._ledger.add_storage_op(StorageOp(
            op_id, rec.rid, ack, chunk.host, len(chunk.page_hashes), chunk.page_hashes[0], chunk.page_hashes[-1],
        ))
    if mgr._debug:
        mgr._emit(
            rec.log.debug, audit.CHUNK_LANDED, ack_id=ack, start=chunk.start, end=chunk.end, op_id=op_id,
            latency_s=round(mgr._clock() - chunk.enqueued_at, 6),
        )
    return chunk


def expired_ended(mgr, q: Quarantine, errors: list) -> None:
    """An expired copy finally ended: its host pages, and its slots if already released, go back
    (a pool that raises is noted in ``errors``; the ledger has settled it either way)."""
    mgr._ledger.end_expired(q)
    _free_host(mgr, q.host, errors)
    if q.released:
        try:
            mgr.token_to_kv_pool_allocator.free(q.slots)
        except Exception as err:
            errors.append(err)
    mgr._emit(mgr._log.warning, audit.EXPIRED_COPY_ENDED, rid=q.rid, ack_id=q.ack_id,
              slots_freed=q.slots.numel() if q.released else 0)


def stored(mgr, op_ids: list, errors: list) -> None:
    """Storage ops finished (either way): their host pages go back, in one ``free_host`` call of
    their host indices as a list (the offloader reads each tensor it returned from what it
    remembered of it: nothing joined or read on this thread; an offloader that raises is noted
    in ``errors``)."""
    ops = [mgr._ledger.finish_storage(op_id) for op_id in op_ids]
    if len(ops) == 1:
        _free_host(mgr, ops[0].host, errors)
    else:
        try:
            mgr.offloader.free_host([op.host for op in ops])
        except Exception:  # an offloader's free changes nothing when it raises: op by op, so one
            for op in ops:  # op's bad pages keep no other op's pages from going back
                _free_host(mgr, op.host, errors)
    if mgr._debug:
        for op in ops:
            mgr._emit(mgr._log.debug, audit.STORED, rid=op.rid, op_id=op.op_id, ack_id=op.ack_id, pages=op.pages,
                      first_hash=op.first_hash, last_hash=op.last_hash)


MAX_RELEASE_CHECKS = 1024  # device-side release checks kept unread (a scheduler that never polls)


def queue_release_check(mgr, check) -> None:
    """A device row was released: keep its device-side check until a progress check reads it.

    Bounded: past ``MAX_RELEASE_CHECKS`` unread (progress checks not called), the landed ones are
    read now and, if still too many, the oldest are dropped unread (``lifecycle.release_checks_unread``).
    """
    if mgr._ledger.queue_release_check(check) > MAX_RELEASE_CHECKS:
        release_checks(mgr)
        drop = mgr._ledger.drop_oldest_checks(MAX_RELEASE_CHECKS)
        if drop:
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
    ledger: Ledger = mgr._ledger
    for c, found in ledger.read_release_checks():
        log = mgr._log.bind(rid=c.rid, row=c.row, gen=c.gen)
        mgr._emit(log.error, audit.BAD_RELEASE_ROW, ranges=[tuple(r) for r in c.ranges],
                  problem=_bad_row(found, mgr._pools.slot_end), slots_end=mgr._pools.slot_end, **found,
                  why="checked on the device after the release was issued: reported, not refused")
    if final and ledger.release_checks:
        unread = ledger.drop_oldest_checks(0)
        mgr._emit(mgr._log.warning, audit.RELEASE_CHECKS_UNREAD, unread=unread,
                  why="shutdown: their verdict had not landed")


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


def agreement(tp_group):
    """With a TP group, ``agree(n_writes, n_stored)``: MIN across the group of how many copies and
    storage ops to settle (``Ledger.settleable``); None without one."""
    if tp_group is None:
        return None

    def agree(n_writes: int, n_stored: int) -> tuple[int, int]:
        import torch.distributed as dist

        counts = torch.tensor([n_writes, n_stored], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp_group)
        return int(counts[0]), int(counts[1])

    return agree

"""Request validation: the one place that reads a scheduler request and checks it.

Every scheduler call reads the request through ``read_request`` (shape, ownership, row, lengths)
before it changes anything, and plans its work here (``plan_chunk``; ``lifecycle.release`` plans a
release) with every input checked; the manager acts only on a validated plan. A check that fails
raises a ``LifecycleError`` (``InvalidRequest``, ``InvalidToken``, ``InvalidSlots``) naming the
request; slot ids are checked by ``lifecycle.slots.check_slots``, the one check both plans use.

A request's namespace (``namespace_of``: its LoRA ``extra_key`` and ``cache_salt``, as SGLang 0.5.23
seeds its storage chains) is read once, when its record is created (first sight, readmit), never
per chunk: the chain's tail carries it from there.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from hashing import TokenRangeError, namespace_seed, page_hashes
from lifecycle.errors import InvalidRequest, InvalidToken
from lifecycle.records import Chunk, OffloadedState
from transfer.indices import on_host
from lifecycle.pools import Pools
from lifecycle.slots import check_device_chunk, check_slots

_SHAPE = ("rid", "origin_input_ids", "output_ids", "kv", "finished")
_KV_SHAPE = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")


View = tuple
"""What one call read from a request, checked: ``(row, committed, allocated)`` — a plain tuple
(built on every chunk: a named type would cost more than the unpacking that reads it)."""


def check_shape(req) -> None:
    """The request must be SGLang-shaped (``rid``, token lists, ``kv``, ``finished()``)."""
    missing = [a for a in _SHAPE if not hasattr(req, a)]
    kv = getattr(req, "kv", None)
    missing += [f"kv.{a}" for a in _KV_SHAPE if kv is not None and not hasattr(kv, a)]
    if missing:
        raise InvalidRequest(f"{type(req).__name__} is not a request: it lacks {', '.join(missing)}")
    if not callable(req.finished):
        raise InvalidRequest(f"request {req.rid!r}: finished is not callable")


def committed_len(req):
    """``effective_kv_committed_len()`` when the request has it, else ``kv.kv_committed_len``."""
    effective = getattr(req, "effective_kv_committed_len", None)
    return effective() if callable(effective) else req.kv.kv_committed_len


def _is_len(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def row_of(pool_rows: int, req) -> int:
    """The request's row; InvalidRequest unless an int in ``0 .. pool_rows - 1``."""
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if not isinstance(row, int) or isinstance(row, bool) or row < 0:
        raise InvalidRequest(f"request {getattr(req, 'rid', None)!r} has no req_to_token row ({row!r})")
    if row >= pool_rows:
        raise InvalidRequest(f"request {req.rid!r}: row {row} is outside the pool's {pool_rows} rows")
    return row


def read_request(mgr, req, rec=None, shaped: bool = False) -> View:
    """Check everything a call relies on about ``req`` and return it.

    Args:
        mgr: the manager (its pool's shape and the ownership registry).
        req: the scheduler's request.
        rec: the request's live record, or None on first sight or readmit (then shape and
            ownership are checked too; a record's request passed them when it was recorded, and
            another manager cannot claim it while the record is live).
        shaped: the caller has just run ``check_shape(req)``.
    Raises:
        InvalidRequest: not request-shaped; driven by another manager; no row or a row outside the
            pool; a row other than the one recorded (moved without ``readmit``); KV lengths that
            are not non-negative ints with committed <= allocated <= the row width.
    """
    shape = mgr._pool_shape  # (rows, width) of req_to_token, taken at construction
    if rec is not None:  # the common case, checked in one pass; any doubt takes the full path below
        kv = req.kv
        effective = getattr(req, "effective_kv_committed_len", None)
        committed = effective() if effective is not None and callable(effective) else kv.kv_committed_len
        allocated = kv.kv_allocated_len
        if (kv.req_pool_idx == rec.row and type(committed) is int and type(allocated) is int
                and 0 <= committed <= allocated <= shape[1]):
            return rec.row, committed, allocated
    if rec is None:  # a record's request was checked for shape and ownership when first seen
        if not shaped:
            check_shape(req)
        mgr._owners.check(req, mgr)
        row = row_of(shape[0], req)
    else:
        row = req.kv.req_pool_idx
        if row != rec.row:
            raise InvalidRequest(f"request {rec.rid!r}: row changed from {rec.row} to {row!r} without readmit")
    committed, allocated = committed_len(req), req.kv.kv_allocated_len
    for name, value in (("committed", committed), ("allocated", allocated)):
        if not _is_len(value):
            raise InvalidRequest(f"request {req.rid!r}: kv {name} length {value!r} is not a non-negative int")
    if committed > allocated:
        raise InvalidRequest(f"request {req.rid!r}: committed {committed} > allocated {allocated}")
    if allocated > shape[1]:
        raise InvalidRequest(f"request {req.rid!r}: allocated {allocated} exceeds the row width {shape[1]}")
    return row, committed, allocated


def hashes(rid, tokens, page_size: int, prior, offset: int) -> list[str]:
    """Page hashes of ``tokens``; a bad token raises InvalidToken naming its request position.

    Integer-like tokens (numpy integers) are accepted as their int value.
    """
    try:
        return page_hashes(tokens, page_size, prior)
    except TokenRangeError:
        pass
    clean = []
    for i, t in enumerate(tokens[: len(tokens) - len(tokens) % page_size]):
        try:
            t = operator.index(t)
        except TypeError:
            t, shown = None, repr(t)
        else:
            shown = str(t)
        if t is None or not 0 <= t <= 0xFFFFFFFF:
            raise InvalidToken(
                f"request {rid!r}: token id {shown} at position {offset + i} is not an int in 0..2**32-1"
            ) from None
        clean.append(t)
    return page_hashes(clean, page_size, prior)


_NAMESPACE_FIELDS = ("extra_key", "cache_salt")


def namespace_of(mgr, req) -> str | None:
    """The seed of ``req``'s page hash chain: the prior of its first page (None: no namespace).

    SGLang 0.5.23 seeds every request's chain with ``storage_namespace_seed(req.extra_key,
    req.cache_salt)`` (a LoRA request's ``extra_key`` ends with its adapter id); that algorithm is
    ``hashing.namespace_seed``, None when both fields are absent, so plain requests keep their
    names. A field the request does not have counts as absent (None). With the manager's own
    ``namespace_seed`` (SGLang has none):

    * the request names no namespace: the manager's seed (unchanged behaviour);
    * it names one and the manager has none: the request's seed (SGLang 0.5.23's names);
    * both, and equal: that seed; both, and different: refused. A manager seed declares every
      request's namespace; a request naming another would otherwise either lose the manager's
      isolation or break SGLang's names, so neither is picked silently.

    Raises:
        InvalidRequest: a field that is neither None nor a ``str``, one UTF-8 cannot encode (a lone
            surrogate), or a namespace other than the manager's seed. Reads only: nothing changes.
    """
    extra_key = getattr(req, "extra_key", None)
    cache_salt = getattr(req, "cache_salt", None)
    if extra_key is None and cache_salt is None:
        return mgr.namespace_seed
    fields = []
    for name, value in zip(_NAMESPACE_FIELDS, (extra_key, cache_salt)):
        if value is not None:
            if not isinstance(value, str):
                raise InvalidRequest(f"request {getattr(req, 'rid', None)!r}: {name} {value!r} "
                                     f"({type(value).__name__}) is not a str or None")
            value = str.__str__(value)  # a str subclass is hashed as its characters
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise InvalidRequest(f"request {getattr(req, 'rid', None)!r}: {name} {value!r} is not "
                                     f"encodable as UTF-8 ({err.reason})") from None
        fields.append(value)
    seed = namespace_seed(*fields)
    if mgr.namespace_seed is not None and seed != mgr.namespace_seed:
        raise InvalidRequest(
            f"request {getattr(req, 'rid', None)!r}: its namespace (extra_key={extra_key!r}, "
            f"cache_salt={cache_salt!r}) is not the manager's namespace_seed {mgr.namespace_seed}")
    return seed


def initial_progress(mgr, req) -> OffloadedState:
    """Offload progress on first sight: the chain tail of the page-aligned prompt, chained from the
    request's namespace seed (``namespace_of``; the tail is the seed when the prompt has no page)."""
    seed = namespace_of(mgr, req)
    tokens = req.origin_input_ids
    prefill = len(tokens) - len(tokens) % mgr.page_size
    names = hashes(req.rid, tokens[:prefill], mgr.page_size, seed, 0)
    return OffloadedState(0, names[-1] if names else seed)


def row_slots(table: torch.Tensor, row: int, start: int, end: int,
              rows: np.ndarray | None = None) -> tuple[torch.Tensor | np.ndarray, np.ndarray | None]:
    """``table[row, start:end]`` as fresh int64 ids: the chunk's slot ids for ``Offloader.write``,
    and the same ids as NumPy for the slot check (None: not read on the host). In host memory one
    NumPy copy-convert, handed to both as it is: no tensor is made on the scheduler thread (each
    costs 10-25 µs there on cold caches; docs/architecture.md, "The GIL on the scheduler thread").
    On a device a device-side copy (a tensor), never read on the host (no sync): its values are
    checked on the device (``lifecycle.slots.check_device_chunk``) and where the copy runs
    (``transfer.gather.ChunkCopy``); a bad chunk is a failed copy."""
    if rows is not None or on_host(table):
        a = (table.numpy() if rows is None else rows)[row, start:end].astype(np.int64)
        return a, a
    return table[row, start:end].to(torch.int64, copy=True), None


def plan_chunk(pools: Pools, ledger, rec, req, view: View, n: int) -> Chunk:
    """The next ``n``-token chunk of ``req``, fully checked before any state changes.

    Reads ``pools`` (page size, row table, allocator), the ``ledger`` (copies in flight, page names)
    and the record's progress (``rec.offload``); writes nothing but the checked ids it leaves in the
    ledger's planned slots for the chunk's commit. Returns the ``Chunk`` or raises.

    Raises:
        InvalidRequest: the chunk has tokens whose KV is not committed.
        InvalidToken: a token of the chunk is not an int in 0..2**32-1.
        InvalidSlots: the row lists, for the chunk, a -1 or repeated slot id, one a copy in flight
            still reads, or one the allocator does not hold (``lifecycle.slots.check_slots``, the
            check the release plan makes). A row on a device is never refused here: the same is
            checked on the device (``check_device_chunk``) and a bad chunk's copy fails.
    """
    row, committed, _ = view
    ps = pools.page_size
    origin, out = req.origin_input_ids, req.output_ids
    n_in = len(origin)
    start = n_in - n_in % ps + rec.offload.inc_len
    end = start + n
    if end > committed:
        raise InvalidRequest(
            f"request {rec.rid!r}: chunk [{start}, {end}) has tokens whose KV is not committed "
            f"(committed {committed!r})"
        )
    # a list's slice is already a private copy; other sequences (tuples, arrays) are copied once
    if end <= n_in:
        tokens = origin[start:end]
    elif start >= n_in:
        tokens = out[start - n_in : end - n_in]
    else:
        tokens = list(origin[start:]) + list(out[: end - n_in])
    if type(tokens) is not list:
        tokens = list(tokens)
    try:
        names = page_hashes(tokens, ps, rec.offload.last_hash)
    except TokenRangeError:
        names = hashes(rec.rid, tokens, ps, rec.offload.last_hash, start)
    table, rows = pools.table()
    indices, ids = row_slots(table, row, start, end, rows)
    if ids is not None:
        check_slots(pools, ledger, rec.rid, row, ((start, end),), ids, "offload", indices=indices, names=names,
                    serial=rec.serial)
    else:  # on the device, no host read: a chunk that fails is a failed copy, never stored
        check_device_chunk(pools, ledger, indices)
    # the page before the chunk: none before the chain's first page (its prior, the namespace
    # seed when there is one, is no page); every chunk and the prefill are whole pages
    parent = rec.offload.last_hash if start else None
    # tuples: the collector untracks them (ints, strings), where a list stays tracked while in flight
    return Chunk(0, req, rec, start, end, None, tuple(tokens), tuple(names), 0.0, indices, parent)

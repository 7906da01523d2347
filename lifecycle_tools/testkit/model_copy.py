"""The bounded model check's deep copy of a manager: an independent ``DecodeOffloadManager`` over
copied requests, to explore what-if orderings. Test-kit code (it knows the manager's and the
ledger's internals); the library has no ``__deepcopy__``.

    mgr = CopyableManager(req_to_token_pool, allocator, page_size=16, offloader=offloader)
    twin, req2 = copy.deepcopy((mgr, req))
"""

from __future__ import annotations

import copy
import weakref
from collections import deque

import msgspec

from lifecycle import DecodeOffloadManager
from lifecycle.states import State
from lifecycle.table import OFFLOADERS, OWNERS, drop_callback

_RELEASED = State.RELEASED


class CopyableManager(DecodeOffloadManager):
    """A ``DecodeOffloadManager`` that ``copy.deepcopy`` copies with ``deep_copy``."""

    def __deepcopy__(self, memo) -> "CopyableManager":
        return deep_copy(self, memo)


def deep_copy(mgr, memo):
    """An independent copy of ``mgr`` and everything it refers to, requests included.

    Records are re-keyed to the copied requests (they are keyed by identity, weakly), so a copy
    can be driven on its own: used to explore what-if orderings (the bounded model check).
    The logger (and its rate limiter), clock, TP group and ownership registry are shared.
    """
    new = object.__new__(type(mgr))
    memo[id(mgr)] = new
    shared = {"_log", "_alerts", "_clock", "tp_group", "_owners"}  # the ledger: copied below
    for key in shared:
        new.__dict__[key] = mgr.__dict__[key]
    old = mgr._ledger
    ledger = object.__new__(type(old))
    memo[id(old)] = ledger
    ledger.dropped = deque()
    ledger.on_drop = drop_callback(ledger.dropped, OWNERS)
    ledger.records = {}
    for rec in list(old.records.values()):
        req = rec.ref()
        if req is None:
            continue
        twin = copy.deepcopy(req, memo)
        clone = msgspec.structs.replace(
            rec, ref=weakref.KeyedRef(twin, ledger.on_drop, id(twin)),
            offload=msgspec.structs.replace(rec.offload),
        )
        memo[id(rec)] = clone
        ledger.records[id(twin)] = clone
    ledger.logger = old.logger
    ledger.holders = {serial: memo[id(rec)] for serial, rec in old.holders.items() if id(rec) in memo}
    for key, value in old.__dict__.items():
        if key not in ("records", "dropped", "on_drop", "logger", "holders"):
            ledger.__dict__[key] = copy.deepcopy(value, memo)
    new._ledger = ledger
    for key, value in mgr.__dict__.items():
        if key not in shared and key != "_ledger":
            new.__dict__[key] = copy.deepcopy(value, memo)
    if not new.closed:
        OFFLOADERS.claim(new.offloader, new)  # the copy owns the copied offloader
    for rec in ledger.records.values():
        req = rec.ref()
        if req is not None and rec.state is not _RELEASED:
            OWNERS.claim(req, new, rec.ref)
    return new

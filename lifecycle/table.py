"""The ownership registries that stop two managers from driving one request or one offloader, the
records' weak-reference callback, and the model checker's deep copy of a manager. The record table
itself (one ``Record`` per live request, keyed by identity, held weakly) is the ledger's
(``lifecycle.ledger``)."""

from __future__ import annotations

import copy
import weakref
from collections import deque

import msgspec

from lifecycle.errors import ConfigError, InvalidRequest
from lifecycle.states import State

_RELEASED = State.RELEASED


def drop_callback(dropped: deque, owners: "Owners"):
    """The weak-reference callback of a manager's records (one per manager, shared by all of
    them): queue the dropped request's ref for ``drain_dropped`` and forget its ownership claim.
    May run inside the garbage collector: it only appends to a deque and deletes a dict entry."""
    append, forget = dropped.append, owners.forget

    def dropped_request(ref) -> None:
        append(ref)
        forget(ref)

    return dropped_request


class Claim(msgspec.Struct, gc=False):
    """An ownership claim: the claiming record's weak reference to the request (shared with the
    record, not a second one) and a weak reference to the manager (one per manager). Untracked
    by the cycle collector."""

    ref: weakref.KeyedRef
    mgr: weakref.ref


class Owners:
    """Which manager holds each live request, so a request cannot be driven by two managers.

    One registry per process (``OWNERS``); entries are weak on both sides. An entry is forgotten
    when its request is dropped, by the claiming record's weak-reference callback
    (``drop_callback``).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Claim] = {}

    def owner(self, req):
        """The manager that claimed ``req`` last (None when none is alive)."""
        claim = self._by_id.get(id(req))
        if claim is None or claim.ref() is not req:
            return None
        return claim.mgr()

    def check(self, req, mgr) -> None:
        """InvalidRequest when another live manager holds ``req`` in a state other than RELEASED."""
        owner = self.owner(req)
        if owner is None or owner is mgr:
            return
        rec = owner._ledger.lookup(req)
        if rec is not None and rec.state is not _RELEASED:
            raise InvalidRequest(f"request {req.rid!r} belongs to another manager (state {rec.state.name} there)")

    def claim(self, req, mgr, ref: weakref.KeyedRef) -> None:
        """Record ``mgr`` as the manager of ``req``; ``ref`` is its record's weak reference to
        ``req`` (keyed by ``id(req)``, its callback made by ``drop_callback``)."""
        if ref() is not req or ref.key != id(req):
            raise ValueError("a claim's reference must be a KeyedRef to the request, keyed by its id")
        self._by_id[ref.key] = Claim(ref, weakref.ref(mgr))

    def forget(self, ref) -> None:
        """Drop the claim made with ``ref`` (a request was dropped); a newer claim stays."""
        claim = self._by_id.get(ref.key)
        if claim is not None and claim.ref is ref:
            del self._by_id[ref.key]


OWNERS = Owners()


class Offloaders:
    """Which manager uses each offloader: two managers over one offloader would number their
    copies alike and settle each other's completions, so the second is refused."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}

    def claim(self, offloader, mgr) -> None:
        """Raises ConfigError when a live, open manager already uses ``offloader``."""
        entry = self._by_id.get(id(offloader))
        if entry is not None:
            off, owner = entry[0](), entry[1]()
            if off is offloader and owner is not None and owner is not mgr and not owner.closed:
                raise ConfigError(
                    "this offloader already serves another DecodeOffloadManager; give each manager its own "
                    "(their ack ids and completions would mix)"
                )
        try:
            ref = weakref.ref(offloader, lambda _r, key=id(offloader): self._forget(key, _r))
        except TypeError:  # not weak-referenceable: remember it strongly by identity only while mgr lives
            ref = lambda o=offloader: o  # noqa: E731
        self._by_id[id(offloader)] = (ref, weakref.ref(mgr))

    def _forget(self, key, ref) -> None:
        entry = self._by_id.get(key)
        if entry is not None and entry[0] is ref:
            del self._by_id[key]


OFFLOADERS = Offloaders()


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

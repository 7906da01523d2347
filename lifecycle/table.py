"""The ownership registries that stop two managers from driving one request or one offloader, and
the records' weak-reference callback. The record table itself (one ``Record`` per live request,
keyed by identity, held weakly) is the ledger's (``lifecycle.ledger``); the model checker's deep
copy of a manager is the test kit's (``lifecycle_tools.testkit.model_copy``)."""

from __future__ import annotations

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

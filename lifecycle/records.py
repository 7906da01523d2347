"""The manager's bookkeeping: small msgspec Structs, one concept each."""

from __future__ import annotations

import msgspec

from lifecycle.states import State


class OffloadedState(msgspec.Struct, gc=False):
    """Offload progress of one request (SGLang's shape; the prefill length is derived).

    ``inc_len`` counts decode-side tokens already submitted for offload; ``last_hash`` is the tail
    of the request's page hash chain (the prefill part, then every submitted chunk).
    """

    inc_len: int = 0
    last_hash: str | None = None


class Record(msgspec.Struct, gc=False):
    """One request's lifecycle. Holds the request only weakly (``ref``); never in a cycle.

    Untracked by the cycle collector, like every per-request struct here: the only collector-
    tracked object a live request costs the manager is ``ref`` (a ``weakref.KeyedRef``, which the
    ownership registry shares; its callback is one object per manager).
    """

    ref: object
    rid: object
    row: int
    state: State
    offload: OffloadedState
    logger: object  # the manager's logger; ``log`` binds it to this request
    inflight: int = 0
    slots: int = 0
    generation: int = 0
    expired: tuple | None = None  # ack ids of this request's expired copies still quarantined
    serial: int = 0  # this lifecycle's number in the ledger (a readmit starts a new one): ``PageNames``

    # A record is also the ``lifecycle.states.Facts`` of a trigger that carries no call facts.
    finished = False
    finalizing = False

    @property
    def log(self):
        """The manager's logger bound to this request (``rid``, ``row``, ``gen``), built per use and
        not kept: most requests never log, and a kept bound logger would be one more object per
        live request for the cycle collector to walk (the events are off the fast path)."""
        return self.logger.bind(rid=self.rid, row=self.row, gen=self.generation)


class Chunk(msgspec.Struct, gc=False):
    """A GPU -> host copy in flight. Holds the request strongly until it lands.

    Not tracked by the cycle collector (nor are its ``tokens`` and ``page_hashes``: tuples of ints
    and strings, which the collector untracks at its first pass): it is never in a reference cycle
    (nothing it holds refers back to it). The two slot tensors stay tracked (torch tensors are).
    """

    ack_id: int
    req: object
    rec: Record
    start: int
    end: int
    host: object
    tokens: tuple
    page_hashes: tuple
    enqueued_at: float
    indices: object = None  # the int64 device slots the copy reads (planned before the offload): NumPy for a host row, a tensor on a device
    parent_hash: str | None = None  # the page before the chunk's first (its hash chain's parent)


class StorageOp(msgspec.Struct, gc=False):
    """A host -> storage write in flight; its host pages are freed when it finishes."""

    op_id: int
    rid: object
    ack_id: int
    host: object
    pages: int
    first_hash: str
    last_hash: str


class Quarantine(msgspec.Struct, gc=False):
    """An expired copy that may still read ``slots``: they are freed only once it ends.
    ``disowned``: their owner freed them under the copy (SGLang, once its TP=1 release wait ran
    out): they are no longer this manager's to free or to guard (``disown_expired_copies``)."""

    ack_id: int
    rid: object
    host: object
    slots: object
    released: bool = False
    disowned: bool = False


class ReleaseCheck(msgspec.Struct, gc=False):
    """The device-side check of a released device row's slot ids (``transfer.gather.
    check_ids_on_device``): ``verdict`` is host memory the device writes after the release call
    returned; a later ``check_offload_progress`` reads it once ``event`` has fired (None: off CUDA,
    there at once). ``rid``, ``row``, ``gen``, ``ranges``: what the report names."""

    rid: object
    row: int
    gen: int
    ranges: tuple
    verdict: object  # int64 host tensor (pinned on CUDA), transfer.gather.ID_VERDICT
    event: object = None  # torch.cuda.Event recorded after the verdict's copy


class Stats(msgspec.Struct):
    """Counters; cheap to take at any time."""

    tracked: int
    inflight_writes: int
    inflight_storage: int
    released: int
    leaked: int
    by_state: dict[str, int]
    chunks_enqueued: int
    pages_enqueued: int
    chunks_landed: int
    storage_finished: int
    host_short: int
    copies_expired: int = 0
    copy_failures: int = 0
    quarantined_slots: int = 0
    unsettled: int = 0  # completions reported by the offloader, not settled yet (check_offload_progress)
    transitions: dict[str, int] = msgspec.field(default_factory=dict)  # state changes by trigger
    abandoned: int = 0  # copies and storage ops still in flight when shutdown(force=True)'s bound ran out
    bad_release_rows: int = 0  # released device rows whose slot ids the device-side check found bad (reported)


class RecordView(msgspec.Struct):
    """A debugging snapshot of one live record (``DecodeOffloadManager.snapshot``)."""

    rid: str
    state: str
    row: int
    inflight: int
    inc_len: int
    last_hash: str | None
    generation: int

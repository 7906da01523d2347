"""SGLang 0.5.19's KV-event structs and its KV-event subscriber, copied verbatim for tests.

SGLang cannot be imported in this test environment, so what decides how SGLang reads a KV-event
stream is copied here from its source (``sglang-0.5.19``). The copied lines are marked
``# --- verbatim`` / ``# --- end``.

* the structs (``EventBatch`` ... ``KVEventBatch``, ``StorageMedium``; not ``OffloadedState``,
  which is no event): ``sglang/srt/disaggregation/kv_events.py``
* ``KVEventsSubscriber`` (``start``, ``stop``, ``_run``: the SUB loop that decodes every message as a
  ``KVEventBatch`` and logs "KVEventsSubscriber error decoding message" when one does not decode):
  ``sglang/srt/mem_cache/storage/umbp/umbp_store.py``. Its ``__init__`` keeps SGLang's attributes
  without the UMBP client (it needs ``mori``), and ``on_event`` records each event instead of
  forwarding it to the UMBP master; ``_run`` imports ``KVEventBatch`` from this module.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any, Optional, Union

import msgspec

# SGLang's logger name, so a test reads what SGLang would log
logger = logging.getLogger("sglang.srt.mem_cache.storage.umbp.umbp_store")


# --- verbatim: sglang/srt/disaggregation/kv_events.py
class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class KVCacheEvent(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """Base class for all KV cache-related events"""


class StorageMedium(str, enum.Enum):
    """Storage tier for KV cache events."""

    GPU = "GPU"  # L1: device HBM
    CPU = "CPU_PINNED"  # L2: host pinned memory
    DISK = "DISK"  # L3: SSD / NVMe
    EXTERNAL = "EXTERNAL"  # L4: shared / remote pool (e.g. Mooncake)


class BlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    """Typed request metadata attached to a stored KV block."""

    cache_salt: str


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only=True):
    """BlockStored wire extension used only when typed metadata is present.

    A separate struct keeps unsalted events at their legacy array length; an
    optional field on BlockStored would still serialize a trailing null.
    """

    metadata: BlockStoredMetadata


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    # BlockStoredWithMetadata deliberately stays out of this tagged union.
    # Existing typed consumers decode its shared "BlockStored" tag as the base
    # type and ignore the trailing metadata; adding both types would give
    # msgspec duplicate tags and make the union invalid.
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
# --- end


class KVEventsSubscriber:
    """SGLang 0.5.19's ``KVEventsSubscriber`` (see the module): ``received`` holds
    ``(event, batch_ts, attn_dp_rank)`` for every event it decoded, in order."""

    def __init__(
        self,
        endpoint: str = "tcp://localhost:5557",
        topic: str = "",
        poll_timeout_ms: int = 100,
        dp_rank: Optional[int] = None,
    ) -> None:
        self._endpoint = endpoint
        self._topic = topic
        self._poll_timeout_ms = poll_timeout_ms
        # When set, only process events whose attn_dp_rank matches (DP mode).
        self._dp_rank = dp_rank
        self._stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.received: list = []

    # --- verbatim: KVEventsSubscriber.start / stop
    def start(self) -> None:
        """Start the subscriber background thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_event.clear()
        self._thread = threading.Thread(
            target=self._run,
            daemon=True,
            name="kv-events-subscriber",
        )
        self._thread.start()
        logger.info(
            "KVEventsSubscriber started: endpoint=%s, topic=%r",
            self._endpoint,
            self._topic,
        )

    def stop(self, timeout: float = 2.0) -> None:
        """Signal the subscriber thread to stop and wait for it to finish."""
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None
        logger.info("KVEventsSubscriber stopped")
    # --- end

    def on_event(self, event: Any, batch_ts: float, attn_dp_rank: Optional[int]) -> None:
        # --- verbatim: the head of KVEventsSubscriber.on_event
        if self._dp_rank is not None:
            event_dp_rank = attn_dp_rank if attn_dp_rank is not None else 0
            if event_dp_rank != self._dp_rank:
                return
        # --- end
        self.received.append((event, batch_ts, attn_dp_rank))

    # --- verbatim: KVEventsSubscriber._run (its KVEventBatch import: this module's)
    def _run(self) -> None:
        import zmq
        from msgspec.msgpack import Decoder

        decoder = Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.connect(self._endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        logger.debug(
            "KVEventsSubscriber connected to %s, topic=%r", self._endpoint, self._topic
        )

        try:
            while not self._stop_event.is_set():
                if not sub.poll(self._poll_timeout_ms):
                    continue
                try:
                    parts = sub.recv_multipart()
                    # Publisher sends: [topic, seq_bytes, payload]
                    if len(parts) != 3:
                        logger.warning(
                            "Unexpected frame count %d from publisher", len(parts)
                        )
                        continue
                    _, _seq_bytes, payload = parts
                    batch = decoder.decode(payload)
                    for event in batch.events:
                        self.on_event(event, batch.ts, batch.attn_dp_rank)
                except Exception:
                    logger.exception("KVEventsSubscriber error decoding message")
        finally:
            sub.close(linger=0)
    # --- end

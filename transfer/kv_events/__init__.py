"""KV events for KV-aware routers: pages that reach host memory or a storage tier, announced in
SGLang 0.5.19's wire format (``wire``) on a ZMQ PUB socket (``publisher``, needs the ``events``
extra: pyzmq); ``announcer`` ties a storage tier and a host offloader to a publisher."""

from transfer.kv_events.announcer import ChainOrder, HostAnnouncer, TierAnnouncer, medium_of
from transfer.kv_events.wire import (
    CPU_PINNED, DISK, END_SEQ, EXTERNAL, GPU, BlockRemoved, BlockStored, KVEventBatch, decode_batch,
    encode_batch, encode_event, hash_str_to_int64, join_batch,
)
from transfer.kv_events.publisher import KVEventPublisher, KVEventsError, KVEventStats, check_endpoint  # pyzmq: at construction


__all__ = [
    "CPU_PINNED", "DISK", "END_SEQ", "EXTERNAL", "GPU", "BlockRemoved", "BlockStored", "ChainOrder",
    "HostAnnouncer", "KVEventBatch", "KVEventPublisher", "KVEventStats", "KVEventsError", "TierAnnouncer",
    "check_endpoint", "decode_batch", "encode_batch", "encode_event", "hash_str_to_int64", "join_batch",
    "medium_of",
]

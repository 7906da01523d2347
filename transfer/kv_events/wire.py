"""The KV-event wire format of SGLang 0.5.19 (``sglang/srt/disaggregation/kv_events.py``), the same
as vLLM's: what a KV-aware router (Dynamo's KV router, SGLang's own) subscribes to.

A message is a ZMQ multipart ``(topic, sequence, payload)``: ``topic`` the publisher's topic
bytes (default empty), ``sequence`` an 8-byte big-endian counter starting at 0, one per batch,
``payload`` a msgpack ``KVEventBatch``. Structs are array-like (encoded as msgpack arrays, fields in
declaration order) and events are tagged with their class name as the array's first element::

    KVEventBatch = [ts, [event, ...], attn_dp_rank]
    BlockStored  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

A page's id in ``block_hashes`` is ``hash_str_to_int64`` of its page hash: the id SGLang's own
events give the same page. ``END_SEQ`` (sequence -1, empty payload) closes an answer of the
replay socket, and only there (as SGLang's publisher sends it): a PUB message is always a batch.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

# Storage media (SGLang's ``StorageMedium`` values).
GPU, CPU_PINNED, DISK, EXTERNAL = "GPU", "CPU_PINNED", "DISK", "EXTERNAL"
MEDIA = (GPU, CPU_PINNED, DISK, EXTERNAL)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch of events published under one sequence number."""

    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base class of the KV cache events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    """Pages now held in ``medium``: ``block_hashes`` in chain order, ``parent_block_hash`` the page
    before the first one (None: the first page of a prompt), ``token_ids`` the pages' tokens."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    """Pages no longer held in ``medium``."""

    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    """Every page of the publisher is gone."""


class KVEventBatch(EventBatch):
    """The batch type on the wire: a list of tagged events."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def hash_str_to_int64(hash_str: str) -> int:
    """SGLang's event id of a page (``sglang.srt.mem_cache.utils.hash_str_to_int64``): the first 16
    hex digits of its sha256 page hash as a signed 64-bit integer.

    Raises:
        ValueError: fewer than 16 leading hex digits.
    """
    head = hash_str[:16]
    if len(head) != 16:
        raise ValueError(f"a page hash has at least 16 hex digits, got {hash_str!r}")
    value = int(head, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``."""
    return _ENCODER.encode(batch)


def encode_event(event: Union[BlockStored, BlockRemoved, AllBlocksCleared]) -> bytes:
    """One event's msgpack bytes, as they appear inside a batch (``join_batch``)."""
    return _ENCODER.encode(event)


def join_batch(ts: float, events: list[bytes], attn_dp_rank: Optional[int]) -> bytes:
    """The payload of a batch of events already encoded by ``encode_event``: the bytes
    ``encode_batch`` gives the decoded events (the events are copied, not re-encoded)."""
    n = len(events)
    if n < 16:
        head = bytes((0x90 | n,))                       # fixarray
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")            # array 16
    else:
        head = b"\xdd" + n.to_bytes(4, "big")            # array 32
    return b"".join((b"\x93", _ENCODER.encode(float(ts)), head, b"".join(events), _ENCODER.encode(attn_dp_rank)))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload. Raises msgspec.DecodeError / ValidationError for a malformed one."""
    return _DECODER.decode(payload)

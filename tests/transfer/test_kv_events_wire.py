"""The KV-event wire format against SGLang 0.5.19's own definitions, copied verbatim below from
``sglang/srt/disaggregation/kv_events.py`` (the structs) and ``sglang/srt/mem_cache/utils.py``
(``hash_str_to_int64``), so CI checks compatibility without installing SGLang."""

from __future__ import annotations

import hashlib
import random
from typing import Any, Optional, Union

import msgspec
import pytest

from tests.support.kv_subscriber import int64_id
from transfer.kv_events import wire


# ---- SGLang 0.5.19, verbatim -------------------------------------------------------------------
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


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
# ------------------------------------------------------------------------------------------------


def _hash(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def test_page_ids_are_sglangs_hash_str_to_int64():
    hashes = [_hash(i) for i in range(2000)] + ["f" * 64, "8" + "0" * 63, "7" + "f" * 63, "0" * 64]
    ours = [wire.hash_str_to_int64(h) for h in hashes]
    assert ours == [int64_id(h) for h in hashes]
    assert min(ours) < 0 < max(ours)   # both halves of the signed range occur
    assert wire.hash_str_to_int64("f" * 64) == -1 and wire.hash_str_to_int64("8" + "0" * 63) == -(2**63)
    with pytest.raises(ValueError, match="at least 16 hex digits, got 'abc'"):
        wire.hash_str_to_int64("abc")


def _ours() -> wire.KVEventBatch:
    a, b, c = _hash(1), _hash(2), _hash(3)
    return wire.KVEventBatch(12.5, [
        wire.BlockStored([wire.hash_str_to_int64(b)], wire.hash_str_to_int64(a), list(range(16)), 16, None,
                         wire.DISK),
        wire.BlockStored([wire.hash_str_to_int64(c)], None, [], 16, None, wire.CPU_PINNED),
        wire.BlockRemoved([wire.hash_str_to_int64(b), wire.hash_str_to_int64(c)], wire.EXTERNAL),
        wire.AllBlocksCleared(),
    ], 3)


def test_our_batches_decode_with_sglangs_structs_field_for_field():
    got = msgspec.msgpack.decode(wire.encode_batch(_ours()), type=KVEventBatch)
    ours = _ours()
    assert got.ts == ours.ts and got.attn_dp_rank == 3
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                      "AllBlocksCleared"]
    for theirs, mine in zip(got.events, ours.events):
        assert msgspec.to_builtins(theirs) == msgspec.to_builtins(mine)


def test_sglangs_batches_decode_with_ours():
    rng = random.Random(7)
    ids = [rng.randrange(-(2**63), 2**63) for _ in range(5)]
    theirs = KVEventBatch(1.0, [BlockStored(ids[:3], ids[4], [1, 2, 3, 4], 4, None, "GPU"),
                                BlockRemoved(ids[3:], "CPU_PINNED")], None)
    got = wire.decode_batch(msgspec.msgpack.encode(theirs))
    assert got.events[0].block_hashes == ids[:3] and got.events[0].parent_block_hash == ids[4]
    assert got.events[1].block_hashes == ids[3:] and got.events[1].medium == "CPU_PINNED"


def test_the_payload_is_a_tagged_array_in_declaration_order():
    raw = msgspec.msgpack.decode(wire.encode_batch(_ours()))
    ts, events, rank = raw
    assert ts == 12.5 and rank == 3
    assert events[0][0] == "BlockStored" and events[0][4:] == [16, None, "DISK"]
    assert events[2] == ["BlockRemoved", events[2][1], "EXTERNAL"]
    assert events[3] == ["AllBlocksCleared"]


def test_a_malformed_payload_is_a_decode_error():
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\xc1not msgpack")
    with pytest.raises(msgspec.ValidationError):
        wire.decode_batch(msgspec.msgpack.encode([1.0, [["NoSuchEvent"]], None]))

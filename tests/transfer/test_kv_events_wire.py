"""The KV-event wire format against SGLang 0.5.19's own definitions: its structs and its
subscriber, copied verbatim in ``tests/data/sglang_0_5_19_kv_events.py`` (from
``sglang/srt/disaggregation/kv_events.py`` and ``sglang/srt/mem_cache/storage/umbp/umbp_store.py``),
and ``hash_str_to_int64`` (``sglang/srt/mem_cache/utils.py``, in ``tests/support/kv_subscriber.py``),
so CI checks compatibility without installing SGLang."""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest

from tests.data.sglang_0_5_19_kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.support.kv_subscriber import int64_id
from transfer.kv_events import wire


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


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65535, 65536])     # msgpack array header sizes
@pytest.mark.parametrize("rank", [None, 0, 3, 70000])
def test_a_batch_joined_from_encoded_events_is_the_batch_encoded_whole(n, rank):
    """The publisher encodes each event on the producer's thread and joins them into a batch on its
    own: the bytes are those of the whole batch encoded at once, and SGLang's structs decode them."""
    kinds = _ours().events
    evs = [kinds[i % len(kinds)] for i in range(n)]
    joined = wire.join_batch(7.25, [wire.encode_event(e) for e in evs], rank)
    assert joined == wire.encode_batch(wire.KVEventBatch(7.25, evs, rank))
    got = msgspec.msgpack.decode(joined, type=KVEventBatch)
    assert got.ts == 7.25 and got.attn_dp_rank == rank and len(got.events) == n


def test_the_end_marker_is_no_batch():
    """``END_SEQ`` closes a replay answer; its empty payload is no ``KVEventBatch`` (SGLang's subscriber
    logs an error for it), so it never goes on the PUB socket (``test_kv_events_publisher``)."""
    assert wire.END_SEQ == (-1).to_bytes(8, "big", signed=True)
    with pytest.raises(msgspec.DecodeError, match="truncated"):
        msgspec.msgpack.decode(b"", type=KVEventBatch)

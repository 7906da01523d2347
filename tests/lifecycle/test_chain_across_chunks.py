"""Multi-page chunks continue the chain from the *last* page of the chunk before.

Every page name the manager hands to storage is compared with a reference chain computed here,
independently of ``hashing`` (sha256 over the previous raw digest and the tokens as uint32 LE,
as written in docs and tests/data/hash-vectors.json). A manager that chains the next chunk from
the wrong prior (the chunk's first page, the prefill tail, the seed) stores every page after the
first chunk under a name no other node will ever look up.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import Req
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "hash-vectors.json").read_text())


def reference_chain(tokens, page_size, prior_hex=None):
    """The spec's chain, written out: one name per full page."""
    prior = bytes.fromhex(prior_hex) if prior_hex else b""
    names = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        prior = hashlib.sha256(prior + struct.pack(f"<{page_size}I", *page)).digest()
        names.append(prior.hex())
    return names


@pytest.mark.parametrize("case", VECTORS["chains"] + [VECTORS["seeded_chain"]])
def test_reference_chain_matches_the_known_answers(case):
    assert reference_chain(case["tokens"], case["page_size"], case["prior_hash"]) == case["page_hashes"]


class RecordingOffloader(InMemoryOffloader):
    """Remembers each chunk's device slots at enqueue and its pages' names at storage."""

    def __init__(self, **kw):
        super().__init__(auto_land=False, **kw)
        self.chunks: dict[int, list[int]] = {}          # ack -> device slots
        self.host_of: dict[int, int] = {}               # first host index -> ack
        self.named: dict[int, tuple[list[int], list[str]]] = {}  # ack -> (tokens, names)

    def write(self, device_indices, ack_id):
        host = super().write(device_indices, ack_id)
        if host is not None:
            self.chunks[ack_id] = device_indices.tolist()
            self.host_of[int(host[0])] = ack_id
        return host

    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        self.named[self.host_of.pop(int(host_indices[0]))] = (list(tokens), list(page_hashes))
        return super().write_storage(host_indices, tokens, page_hashes, parent_hash)


def setup(page_size, stride, prompt, seed=None, room=96):
    alloc = PagedTokenAllocator(4 * 128, page_size)
    pool = ReqToTokenPool(4, 128)
    row = pool.alloc()
    slots = alloc.alloc(room)
    pool.req_to_token[row, :room] = slots.to(torch.int32)
    off = RecordingOffloader(page_size=page_size, host_pages=256)
    mgr = DecodeOffloadManager(pool, alloc, page_size=page_size, offloader=off,
                               offload_stride=stride, namespace_seed=seed)
    req = Req("r", [1000 + i for i in prompt], row=row, outputs=(7000,))
    return mgr, off, req, slots


def check_against_reference(mgr, off, req, slots, page_size, seed, expected_chunks):
    """Every enqueued chunk: its slots, its tokens and its page names, against the reference."""
    prefill = len(req.origin_input_ids) // page_size * page_size
    with_kv = req.origin_input_ids + req.output_ids[:-1]
    chain = reference_chain(with_kv, page_size, seed)
    starts = {}
    for ack, dev in off.chunks.items():
        starts[ack] = slots.tolist().index(dev[0])
        assert dev == slots[starts[ack] : starts[ack] + len(dev)].tolist()
    spans = sorted((starts[a], starts[a] + len(off.chunks[a])) for a in off.chunks)
    assert spans == expected_chunks
    assert spans[0][0] == prefill and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for ack, (tokens, names) in off.named.items():
        start = starts[ack]
        assert tokens == with_kv[start : start + len(tokens)]
        first = start // page_size
        assert names == chain[first : first + len(names)], f"chunk at {start} named off the chain"
    end = spans[-1][1]
    assert mgr.progress_of(req).last_hash == chain[end // page_size - 1]


def decode(mgr, req, steps, offload_every=1, first=7001):
    for i in range(steps):
        req.decode(first + i)
        if (i + 1) % offload_every == 0:
            mgr.offload_kv_cache(req)


@pytest.mark.parametrize(
    "page_size,stride,prompt_len,steps,seed,expected",
    [
        # 2-page chunks, prompt tail (2 tokens) starts the first one; two, then three chunks in flight
        (4, 8, 10, 15, None, [(8, 16), (16, 24)]),
        (4, 8, 10, 23, None, [(8, 16), (16, 24), (24, 32)]),
        # 3-page chunks from a namespaced empty prefill
        (4, 12, 3, 34, "ab" * 32, [(0, 12), (12, 24), (24, 36)]),
        # page 2, 2-page stride
        (2, 4, 5, 12, None, [(4, 8), (8, 12), (12, 16)]),
    ],
)
def test_every_page_of_consecutive_multi_page_chunks_is_on_the_reference_chain(
    page_size, stride, prompt_len, steps, seed, expected
):
    mgr, off, req, slots = setup(page_size, stride, range(prompt_len), seed)
    decode(mgr, req, steps)
    assert mgr.stats().inflight_writes == len(expected)   # all enqueued before any landing
    off.land()
    mgr.check_offload_progress()
    check_against_reference(mgr, off, req, slots, page_size, seed, expected)


def test_chunks_that_grew_over_skipped_steps_and_landed_out_of_order():
    """Offloading every 5th step makes chunks of several pages with stride = page; landings are
    reversed and interleaved with enqueues."""
    page_size = 2
    mgr, off, req, slots = setup(page_size, None, range(3))
    decode(mgr, req, 5, offload_every=5)                 # KV 8 tokens: chunk [2, 8)
    decode(mgr, req, 5, offload_every=5, first=7100)     # KV 13: chunk [8, 12)
    off.land([2])
    mgr.check_offload_progress()
    decode(mgr, req, 5, offload_every=5, first=7200)     # KV 18: chunk [12, 18)
    off.land([3, 1])
    mgr.check_offload_progress()
    check_against_reference(mgr, off, req, slots, page_size, None, [(2, 8), (8, 12), (12, 18)])

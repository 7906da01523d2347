"""A request's namespace (``lifecycle.requests.namespace_of``): its LoRA ``extra_key`` and
``cache_salt`` seed its page hash chain as SGLang 0.5.23 seeds it (``storage_namespace_seed``).

Over a real stack (file tier, KV events recorded from the publisher interface): two requests that
differ only in LoRA id or only in salt never share a page name — not in their chains, not in the
storage keys written, not in the KV events; a plain request keeps the token-only names (the known
answers of ``tests/data/hash-vectors.json``); a stored prefix is found only from its own namespace.
The combination with the manager's ``namespace_seed``, bad field values on every entry point, and
the read-once cost (the fields are read when the record is created, never per chunk).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from unittest.mock import MagicMock

import pytest
import torch

import hashing
from lifecycle import DecodeOffloadManager, InvalidRequest, State
from lifecycle_tools.request import Request
from lifecycle_tools.testkit.doubles import Req
from tests.support.real_rig import Rig
from transfer import build_stack

PS = 4
VECTORS = json.loads((Path(__file__).parents[1] / "data" / "hash-vectors.json").read_text())
PROMPT = list(range(100, 110))             # two prompt pages (the prefill node's) and two tokens
OUTPUTS = list(range(500, 512))            # decode: pages [8, 12), [12, 16), [16, 20) get offloaded
NAMESPACES = [                             # (extra_key, cache_salt): each pair differs in one field only
    (None, None), ("lora-1", None), ("lora-2", None), (None, "tenant-a"), (None, "tenant-b"),
    ("lora-1", "tenant-a"), ("", None), (None, ""),
]


class Recorder:
    """The publisher interface of ``transfer.kv_events``: what the tiers announce, in order."""

    def __init__(self):
        self.stored_pages: list[str] = []
        self.parents: dict[str, str | None] = {}   # first page of an announcement -> its parent

    def stored(self, medium, hashes, tokens, block_size, parent=None):
        self.stored_pages += list(hashes)
        self.parents[hashes[0]] = parent

    def removed(self, medium, hashes):
        pass


def _on_disk(directory) -> set[str]:
    return {n[:64] for n in os.listdir(directory) if n.endswith(".bin") and not n.startswith(".")}


def _serve(stack, mgr, req, outputs=OUTPUTS):
    """Decode ``req`` to its end through the manager (SGLang's call pattern), then drain."""
    room = -(-(len(req.origin_input_ids) + len(outputs)) // PS) * PS
    slots = stack.allocator.alloc(room)
    stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :room] = slots.to(torch.int32)
    for token in outputs[1:]:
        req.decode(token)
        mgr.offload_kv_cache(req)
        mgr.check_offload_progress()
    tail = mgr.progress_of(req).last_hash
    req.finish()
    if not mgr.offload_kv_cache(req):
        mgr.finalize_release_on_finish(req)
    deadline = time.monotonic() + 30
    while not (mgr.idle() and stack.offloader.idle()):
        assert time.monotonic() < deadline, mgr.stats()
        mgr.check_offload_progress()
        time.sleep(0.002)
    assert mgr.state_of(req) is State.RELEASED
    return tail


def _request(stack, rid, prompt, extra_key=None, cache_salt=None, outputs=OUTPUTS):
    row = stack.req_to_token_pool.alloc()
    return Request(rid, prompt, row, outputs=outputs[:1], extra_key=extra_key, cache_salt=cache_salt)


def _decode_names(prompt, outputs, seed):
    """The names of the decode-side pages (from the prompt's page boundary on) of a chain at ``seed``."""
    tokens = prompt + outputs[:-1]
    names = hashing.page_hashes(tokens, PS, seed)
    return names[len(prompt) // PS:]


def test_requests_differing_only_in_lora_id_or_salt_never_share_a_page_name(tmp_path):
    rec = Recorder()
    stack = build_stack(1, 1, 8, torch.float32, PS, 512, 256, 16, 64, storage=f"file:{tmp_path}", kv_events=rec)
    mgr = DecodeOffloadManager.from_stack(stack)
    try:
        seen: dict[tuple, set[str]] = {}
        for i, (extra_key, salt) in enumerate(NAMESPACES):
            before_disk, before_events = _on_disk(tmp_path), len(rec.stored_pages)
            req = _request(stack, f"r{i}", PROMPT, extra_key, salt)
            tail = _serve(stack, mgr, req)
            want = _decode_names(PROMPT, OUTPUTS, hashing.namespace_seed(extra_key, salt))
            written = _on_disk(tmp_path) - before_disk              # the storage keys actually written
            announced = rec.stored_pages[before_events:]             # BlockStored of the host and disk tiers
            assert written == set(want) and set(announced) == set(want), (extra_key, salt)
            assert tail == want[-1]                                  # the chain the manager kept
            seen[(extra_key, salt)] = set(want)
        for a, b in itertools.combinations(NAMESPACES, 2):
            assert not seen[a] & seen[b], f"{a} and {b} share a page name"
        assert len(_on_disk(tmp_path)) == 3 * len(NAMESPACES)   # nothing overwritten, nothing merged
    finally:
        mgr.shutdown()
        stack.close()


def test_plain_requests_keep_their_names_and_a_lora_request_gets_sglangs_seeded_chain(tmp_path):
    """Known answers: a plain request's pages are ``chains`` of hash-vectors.json (no seed), a
    request with ``extra_key="lora-a"`` gets ``seeded_chain`` (prior: that key's namespace seed).
    The seed is no page: the first page's KV event has no parent, the next ones the page before."""
    seeded = VECTORS["seeded_chain"]
    assert seeded["prior_hash"] == hashing.namespace_seed("lora-a")
    plain = next(c for c in VECTORS["chains"] if c["page_size"] == PS and c["prior_hash"] is None
                 and len(c["tokens"]) >= 2 * PS)
    rec = Recorder()
    stack = build_stack(1, 1, 8, torch.float32, PS, 512, 256, 8, 64, storage=f"file:{tmp_path}", kv_events=rec)
    mgr = DecodeOffloadManager.from_stack(stack)
    try:
        for case, extra_key in ((plain, None), (seeded, "lora-a")):
            tokens = case["tokens"][: len(case["tokens"]) // PS * PS]
            before = _on_disk(tmp_path)
            # a prompt shorter than a page: every full page is the decode side's, so the manager names all
            req = _request(stack, f"v-{extra_key}", tokens[:1], extra_key, outputs=tokens[1:] + [9])
            _serve(stack, mgr, req, outputs=tokens[1:] + [9])
            names = case["page_hashes"][: len(tokens) // PS]
            assert _on_disk(tmp_path) - before == set(names)
            assert [rec.parents[n] for n in names] == [None] + names[:-1]   # one chunk per page
    finally:
        mgr.shutdown()
        stack.close()


def test_a_stored_prefix_is_found_only_from_its_own_namespace(tmp_path):
    """The manager stores a LoRA request's pages; the next request of the same adapter finds them
    through ``namespace_of`` (the loader's prior), no other namespace (base, another adapter, the
    same adapter salted) finds any of them."""
    stack = build_stack(1, 1, 8, torch.float32, PS, 512, 256, 16, 64, storage=f"file:{tmp_path}")
    mgr = DecodeOffloadManager.from_stack(stack)
    try:
        first = _request(stack, "first", PROMPT[:3], "lora-1")      # no prompt page: all pages are ours
        _serve(stack, mgr, first)
        history = PROMPT[:3] + OUTPUTS[:-1]
        stored = hashing.page_hashes(history, PS, hashing.namespace_seed("lora-1"))
        for extra_key, salt, found in [("lora-1", None, stored), (None, None, []), ("lora-2", None, []),
                                       ("lora-1", "t", []), (None, "lora-1", [])]:
            nxt = Request(f"next-{extra_key}-{salt}", history + [1, 2], extra_key=extra_key, cache_salt=salt)
            seed = mgr.namespace_of(nxt)
            assert stack.prefix_loader.lookup(nxt.origin_input_ids, seed) == found, (extra_key, salt)
        assert stack.prefix_loader.start(1, history, mgr.namespace_of(Request("again", [], extra_key="lora-1"))) == 3
        deadline = time.monotonic() + 30
        while not (loads := stack.prefix_loader.finished()):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert loads[0].page_hashes == stored and loads[0].error is None
        stack.allocator.free(loads[0].device_indices)
    finally:
        mgr.shutdown()
        stack.close()


# --- the manager's namespace_seed and a request's namespace ---------------------------------------

def test_with_a_manager_seed_a_plain_request_uses_it_and_an_equal_request_namespace_is_accepted():
    seed = hashing.namespace_seed("lora-a")
    rig = Rig(PS, namespace_seed=seed)
    plain, _ = rig.admit("plain", 8, 16)
    same, _ = rig.admit("same", 8, 16)
    same.extra_key = "lora-a"
    for req in (plain, same):
        assert rig.mgr.namespace_of(req) == seed
        assert rig.mgr.offload_kv_cache(req) is False            # tracked: the prompt's two pages
        assert rig.mgr.progress_of(req).last_hash == hashing.page_hashes(req.origin_input_ids, PS, seed)[-1]


def test_without_a_manager_seed_the_request_namespace_is_the_seed_and_plain_is_none():
    rig = Rig(PS)
    req, _ = rig.admit("r", 8, 16)
    assert rig.mgr.namespace_of(req) is None
    for extra_key, salt in NAMESPACES[1:]:
        req.extra_key, req.cache_salt = extra_key, salt
        assert rig.mgr.namespace_of(req) == hashing.namespace_seed(extra_key, salt)


class StrSub(str):
    pass


def test_a_str_subclass_is_hashed_as_its_characters():
    req = Req("s", range(8), row=0)
    req.extra_key = StrSub("lora-a")
    assert Rig(PS).mgr.namespace_of(req) == hashing.namespace_seed("lora-a")


LORA_A = hashing.namespace_seed("lora-a")
BAD = [  # (fields set on the request, the error's message, the manager's namespace_seed)
    (dict(extra_key=3), r"request 'bad': extra_key 3 \(int\) is not a str or None", None),
    (dict(extra_key=b"lora"), r"request 'bad': extra_key b'lora' \(bytes\) is not a str or None", None),
    (dict(cache_salt=True), r"request 'bad': cache_salt True \(bool\) is not a str or None", None),
    (dict(cache_salt=MagicMock()), r"request 'bad': cache_salt <MagicMock .*> \(MagicMock\) is not a str or None",
     None),
    (dict(extra_key="lora", cache_salt=["t"]), r"request 'bad': cache_salt \['t'\] \(list\) is not a str or None",
     None),
    (dict(extra_key="\ud800"), r"request 'bad': extra_key '\\ud800' is not encodable as UTF-8", None),
    (dict(extra_key="lora-b"), r"request 'bad': its namespace \(extra_key='lora-b', cache_salt=None\) is not "
                               r"the manager's namespace_seed " + LORA_A, LORA_A),
    (dict(cache_salt="lora-a"), r"request 'bad': its namespace \(extra_key=None, cache_salt='lora-a'\) is not "
                                r"the manager's namespace_seed " + LORA_A, LORA_A),
]
IDS = ["int", "bytes", "bool", "mock", "list", "surrogate", "other-lora", "salt-not-key"]


def _rig_and_request(seed):
    rig = Rig(PS, namespace_seed=seed)
    req, _ = rig.admit("bad", 8, 16)
    return rig, req


def _unchanged(rig, req, free_before, rows_before):
    """No record, no slot or row freed, no chunk enqueued, no host page taken."""
    assert rig.mgr.state_of(req) is None
    assert (rig.alloc.available_size(), rig.pool.available_size()) == (free_before, rows_before)
    stats = rig.mgr.stats()
    assert (stats.tracked, stats.chunks_enqueued, stats.released) == (0, 0, 0)
    assert rig.off.host_free_pages() == 256


@pytest.mark.parametrize("fields,match,seed", BAD, ids=IDS)
@pytest.mark.parametrize("entry", ["namespace_of", "offload_kv_cache", "finalize_release_on_finish",
                                   "_release_finished_req"])
def test_a_bad_namespace_field_is_refused_by_name_on_every_entry_and_changes_nothing(fields, match, seed, entry):
    rig, req = _rig_and_request(seed)
    for name, value in fields.items():
        setattr(req, name, value)
    for token in range(7001, 7005):                             # a chunk is due: [8, 12)
        req.decode(token)
    if entry != "offload_kv_cache":
        req.finish()
    free, rows = rig.alloc.available_size(), rig.pool.available_size()
    with pytest.raises(InvalidRequest, match=match):
        getattr(rig.mgr, entry)(req)
    _unchanged(rig, req, free, rows)


@pytest.mark.parametrize("fields,match,seed", BAD, ids=IDS)
def test_a_readmitted_request_whose_namespace_went_bad_is_refused_and_stays_released(fields, match, seed):
    rig, req = _rig_and_request(seed)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    assert rig.mgr.state_of(req) is State.RELEASED
    row = rig.pool.alloc()                                      # back with a new row (a retraction)
    slots = rig.alloc.alloc(16)
    rig.pool.req_to_token[row, :16] = slots.to(torch.int32)
    req.kv.req_pool_idx, req._finished = row, False
    for name, value in fields.items():
        setattr(req, name, value)
    free, rows = rig.alloc.available_size(), rig.pool.available_size()
    with pytest.raises(InvalidRequest, match=match):
        rig.mgr.readmit(req)
    assert rig.mgr.state_of(req) is State.RELEASED
    assert (rig.alloc.available_size(), rig.pool.available_size()) == (free, rows)
    for name in fields:
        setattr(req, name, None)
    rig.mgr.readmit(req)                                        # repaired: readmitted
    assert rig.mgr.state_of(req) is State.PREFILLED


# --- cost: read once per record ------------------------------------------------------------------

class CountingNamespace(Req):
    """Counts reads of ``extra_key`` and ``cache_salt``."""

    reads = 0

    @property
    def extra_key(self):
        self.reads += 1
        return "lora-a"

    @property
    def cache_salt(self):
        self.reads += 1
        return None


def test_the_namespace_is_read_once_when_the_record_is_created_not_per_chunk():
    rig = Rig(PS, host_pages=1024, width=256)
    row = rig.pool.alloc()
    slots = rig.alloc.alloc(200)
    rig.pool.req_to_token[row, :200] = slots.to(torch.int32)
    req = CountingNamespace("c", [1000 + i for i in range(6)], row=row, outputs=(7000,))
    assert rig.decode(req, 40).count(True) == 10                 # ten chunks
    rig.off.land()
    rig.progress()
    assert req.reads == 2                                        # each field once, at first sight
    names = hashing.page_hashes(req.origin_input_ids + req.output_ids[:-1], PS, hashing.namespace_seed("lora-a"))
    assert rig.mgr.progress_of(req).last_hash == names[10]

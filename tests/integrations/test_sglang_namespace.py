"""The SGLang drop-in names a LoRA or salted request's pages in the request's namespace, as SGLang
0.5.23 does (``storage_namespace_seed(req.extra_key, req.cache_salt)`` seeds the chain; SGLang
appends a LoRA id to ``extra_key``), and a plain request's pages exactly as SGLang 0.5.19 does.

The HiCacheFile directory is the truth: requests with the same tokens that differ only in LoRA id
or only in salt write disjoint page files; a bad field is refused naming the request, before
anything is tracked or written.
"""

from __future__ import annotations

import itertools
import os

import pytest

from hashing import namespace_seed, page_hashes
from lifecycle import InvalidRequest
from tests.integrations.sglang_kit import Node, doubles_kit, hicache_file_get, hicache_file_suffix
from tests.integrations.test_sglang import MODEL, build, store_dir  # noqa: F401 (fixture)

PROMPT = list(range(10, 23))     # three prompt pages (the prefill node's) and one token
NAMESPACES = [(None, None), ("lora-7", None), ("lora-8", None), (None, "tenant-a"), (None, "tenant-b"),
              ("lora-7", "tenant-a")]


def _files(directory) -> set[str]:
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def test_requests_differing_only_in_lora_id_or_salt_write_disjoint_pages_plain_ones_sglangs_names(store_dir):
    node = Node(doubles_kit())
    mgr = build(node)
    suffix = hicache_file_suffix(MODEL, 0, 1, False)
    nbytes = mgr.decode_host_mem_pool.page_nbytes
    written = {}
    try:
        for i, (extra_key, salt) in enumerate(NAMESPACES):
            before = _files(store_dir)
            req = node.admit(f"r{i}", PROMPT, 11)
            req.extra_key, req.cache_salt = extra_key, salt          # as SGLang's Req carries them
            running = [req]
            while running:
                running = node.decode_step(mgr, running)
            node.drain(mgr)
            tokens = req.origin_input_ids + req.output_ids[:-1]
            assert mgr.namespace_of(req) == namespace_seed(extra_key, salt)
            names = page_hashes(tokens, node.ps, namespace_seed(extra_key, salt))[len(PROMPT) // node.ps:]
            assert _files(store_dir) - before == {f"{h}{suffix}.bin" for h in names}, (extra_key, salt)
            for j, h in enumerate(names):                            # the request's own KV, byte for byte
                start = (len(PROMPT) // node.ps + j) * node.ps
                assert hicache_file_get(store_dir, h, suffix, nbytes) == node.page_bytes(req.rid, start)
            written[(extra_key, salt)] = set(names)
        assert written[(None, None)] == set(page_hashes(tokens, node.ps)[len(PROMPT) // node.ps:])  # 0.5.19's
        for a, b in itertools.combinations(NAMESPACES, 2):
            assert not written[a] & written[b], f"{a} and {b} share a page name"
        stats = mgr.stats()
        assert (stats.released, stats.leaked) == (len(NAMESPACES), 0)
    finally:
        mgr.release_host_resources()


@pytest.mark.parametrize("field,value", [("extra_key", 7), ("cache_salt", b"tenant"), ("extra_key", "\udc80")])
def test_a_bad_namespace_field_is_refused_naming_the_request_before_anything_is_tracked(store_dir, field, value):
    node = Node(doubles_kit())
    mgr = build(node)
    try:
        req = node.admit("bad", PROMPT, 11)
        setattr(req, field, value)
        node.decode_tokens(req, 3)                                   # a chunk is due
        free = node.alloc.available_size()
        with pytest.raises(InvalidRequest, match=rf"request 'bad': {field} "):
            mgr.offload_kv_cache(req)
        assert mgr.manager.state_of(req) is None and mgr.stats().pages_enqueued == 0
        assert node.alloc.available_size() == free and _files(store_dir) == set()
        setattr(req, field, None)                                    # repaired: offloaded as a plain request
        assert mgr.offload_kv_cache(req)
    finally:
        node.drain(mgr)
        mgr.release_host_resources()

"""Namespace seeds of non-ASCII LoRA names and cache salts: lengths are UTF-8 bytes, not characters.

The known answers in tests/data/namespace-vectors.json were derived from the written spec by a
second implementation (``spec_seed`` below, which shares no code with ``hashing``) and one of them
byte by byte with ``printf | sha256sum``. Every case has a field whose UTF-8 length differs from its
length in characters, so a seed that counts characters (or UTF-16 units) fails here.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from hashing import namespace_seed, page_hashes
from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import Req
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

DATA = Path(__file__).parents[1] / "data"
ASCII = json.loads((DATA / "hash-vectors.json").read_text())
NON_ASCII = json.loads((DATA / "namespace-vectors.json").read_text())
TAG = b"sglang-cache-namespace-v1"


def spec_seed(extra_key, cache_salt, length=lambda raw, text: len(raw)):
    """The spec, written out: absent field ``00``; present ``01``, u64 LE length, UTF-8 bytes."""
    if extra_key is None and cache_salt is None:
        return None
    preimage = TAG
    for text in (extra_key, cache_salt):
        if text is None:
            preimage += b"\x00"
        else:
            raw = text.encode("utf-8")
            preimage += b"\x01" + struct.pack("<Q", length(raw, text)) + raw
    return hashlib.sha256(preimage).hexdigest()


def ids(case):
    return f"{case['extra_key']!a}-{case['cache_salt']!a}"


@pytest.mark.parametrize("case", ASCII["namespace_seeds"], ids=ids)
def test_second_implementation_agrees_with_the_shared_ascii_vectors(case):
    assert spec_seed(case["extra_key"], case["cache_salt"]) == case["seed"]


@pytest.mark.parametrize("case", NON_ASCII["namespace_seeds"], ids=ids)
def test_non_ascii_namespace_seed(case):
    assert spec_seed(case["extra_key"], case["cache_salt"]) == case["seed"]
    assert namespace_seed(case["extra_key"], case["cache_salt"]) == case["seed"]


@pytest.mark.parametrize("case", NON_ASCII["namespace_seeds"], ids=ids)
def test_each_vector_tells_bytes_from_characters(case):
    """The vectors are discriminating: counting characters or UTF-16 units gives another seed."""
    chars = spec_seed(case["extra_key"], case["cache_salt"], lambda raw, text: len(text))
    assert chars != case["seed"]
    utf16 = spec_seed(case["extra_key"], case["cache_salt"],
                      lambda raw, text: len(text.encode("utf-16-le")) // 2)
    if any(ord(c) > 0xFFFF for c in (case["extra_key"] or "") + (case["cache_salt"] or "")):
        assert utf16 != case["seed"]


def test_chain_seeded_by_a_non_ascii_namespace():
    case = NON_ASCII["seeded_chain"]
    assert case["prior_hash"] == spec_seed(None, "\u65e5\u672c\u8a9e")
    assert page_hashes(case["tokens"], case["page_size"], case["prior_hash"]) == case["page_hashes"]


def test_manager_chains_a_non_ascii_namespace_from_its_seed():
    case = NON_ASCII["seeded_chain"]
    ps = case["page_size"]
    alloc, pool = PagedTokenAllocator(4 * 64, ps), ReqToTokenPool(4, 64)
    row = pool.alloc()
    pool.req_to_token[row, :16] = alloc.alloc(16).to(torch.int32)
    mgr = DecodeOffloadManager(pool, alloc, page_size=ps, offloader=InMemoryOffloader(page_size=ps),
                               namespace_seed=namespace_seed(None, "\u65e5\u672c\u8a9e"))
    req = Req("r", case["tokens"], row=row)
    assert mgr.offload_kv_cache(req) is False       # first sight: the prefill pages are hashed
    assert mgr.progress_of(req).last_hash == case["page_hashes"][-1]

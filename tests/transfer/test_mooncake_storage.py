"""The Mooncake tier against a real ``mooncake_master``: SGLang's object names and bytes both ways,
the seal (corrupt, renamed, foreign-format and wrong-size objects are misses), specs and bad input.

A second, raw ``MooncakeDistributedStore`` client plays SGLang's part: it reads and writes objects
exactly as ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py`` (0.5.19) does.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import threading
import time

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle_tools.testkit.mooncake_server import (  # noqa: F401 (fixtures)
    free_port, mooncake_master, mooncake_session_master, require_mooncake,
)
from tests.data.sglang_0_5_19 import MooncakeStoreNames, storage_config_from_controller
from tests.support.sglang_pages import fill_random, random_host, same_kv, sglang_pool
from transfer import build_stack, open_storage
from transfer.errors import InvalidKey, PageSizeMismatch, StorageConfigError, StorageUnavailable
from transfer.storage.integrity import PageFormat
from transfer.storage.mooncake.store import MooncakeStorage
from transfer.storage.mooncake.conn import EXTRA_HINT, import_store, parse_size, parse_spec
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.mooncake.keys import MooncakeNaming

PS, LAYERS, HEADS, DIM = 4, 2, 2, 8
MHA = PageFormat.of("page_first", torch.bfloat16, (2, PS, LAYERS, HEADS, DIM))
NB = 2 * PS * LAYERS * HEADS * DIM * 2  # bytes of one MHA bf16 page
TINY = DeploymentIdentity(model_name="org/tiny", tp_rank=1, tp_size=2)  # the module store's deployment
M = DeploymentIdentity(model_name="m")
_counter = itertools.count()


def fresh_hashes(n: int) -> list[str]:
    """Page hashes never used before in this session (the session master is shared)."""
    return [hashlib.sha256(f"{time.time_ns()}-{next(_counter)}".encode()).hexdigest() for _ in range(n)]


def pages(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` random pages in one pool-like tensor (rows are page views sharing one storage)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NB), dtype=torch.uint8, generator=g)


def sglang_keys(page_hash: str, model: str, tp_rank: int, mla: bool, pp_rank: int = 0, pp_size: int = 1):
    """SGLang 0.5.19's names, transcribed from MooncakeStore.__init__ / _tag_keys / _get_*_buffer_meta."""
    config_prefix = "-".join(model.split("/")) if model else None
    key = f"{config_prefix}_{page_hash}" if config_prefix is not None else page_hash
    if pp_size > 1:
        mha_suffix, mla_suffix = f"{tp_rank}_{pp_rank}", f"{pp_rank}"
    else:
        mha_suffix, mla_suffix = f"{tp_rank}", ""
    if mla:
        return [f"{key}_{mla_suffix}_k"]
    return [f"{key}_{mha_suffix}_k", f"{key}_{mha_suffix}_v"]


@pytest.fixture(scope="module")
def module_master(mooncake_session_master):
    require_mooncake()
    return mooncake_session_master


@pytest.fixture(scope="module")
def raw(module_master):
    """A raw Mooncake client on the same master (SGLang's side), contributing no segment."""
    store_cls, _ = import_store()  # quiet C++ logging, as for our own clients
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = store_cls()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", module_master.address) == 0
    yield client
    client.close()


@pytest.fixture(scope="module")
def shared_store(module_master):
    s = open_storage(module_master.spec(), page_nbytes=NB, identity=TINY, page_format=MHA)
    yield s
    s.close()


class Counted:
    """The module's store, with ``stats()`` counted from the start of the test."""

    def __init__(self, store):
        self._store, self._base = store, store.stats()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def stats(self):
        now, base = self._store.stats(), self._base
        return type(now)(**{f: getattr(now, f) - getattr(base, f) for f in now.__struct_fields__})


@pytest.fixture
def store(shared_store):
    return Counted(shared_store)


# --- naming ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,tp,mla,pp,pps", [("org/tiny", 1, False, 0, 1), ("org/tiny", 0, True, 0, 1),
                                                 ("m", 3, False, 1, 2), ("m", 0, True, 1, 4), ("", 0, False, 0, 1)])
def test_object_names_follow_sglang_rules(model, tp, mla, pp, pps):
    h = "ab" * 32
    naming = MooncakeNaming(model_name=model, tp_rank=tp, pp_rank=pp, pp_size=pps, mla=mla)
    assert naming.objects(h) == sglang_keys(h, model, tp, mla, pp, pps)
    assert naming.seal_object(h).endswith("_kvlp") and naming.seal_object(h) not in naming.objects(h)


def test_naming_is_built_from_the_identity_never_from_a_suffix_string():
    assert MooncakeNaming.of(TINY) == MooncakeNaming("org/tiny", 1)
    pp = DeploymentIdentity(model_name="org/m", tp_rank=0, tp_size=2, pp_rank=1, pp_size=2, mla=True)
    assert MooncakeNaming.of(pp) == MooncakeNaming("org/m", 0, 1, 2, mla=True)
    with pytest.raises(StorageConfigError, match="identity"):  # a suffix string is never parsed back
        open_storage("mooncake://127.0.0.1:1", "_org-tiny_1_2", NB)


def test_our_pages_are_sglang_objects_and_sglang_reads_them(store, raw):
    h = fresh_hashes(2)
    pool = pages(2)
    assert store.batch_set(h, [pool[0], pool[1]]) == [True, True]
    k_name, v_name = sglang_keys(h[1], "org/tiny", 1, mla=False)
    assert raw.batch_is_exist([k_name, v_name, f"org-tiny_{h[1]}_1_kvlp"]) == [1, 1, 1]
    # SGLang's batch_get_v1: zero-copy into K and V of its host page, exact object sizes
    out = torch.zeros(NB, dtype=torch.uint8)
    half = NB // 2
    assert raw.batch_get_into([k_name, v_name], [out.data_ptr(), out.data_ptr() + half], [half, half]) == [half, half]
    assert torch.equal(out, pool[1])


def test_sglang_pages_are_served_unverified_or_refused_in_strict_mode(store, module_master, raw):
    h = fresh_hashes(1)[0]
    page = pages(1, seed=5)[0]
    half = NB // 2
    names = sglang_keys(h, "org/tiny", 1, mla=False)  # what SGLang's tp rank 1 writes
    strict = open_storage(module_master.spec(require_checksum=1, global_segment_size=0), page_nbytes=NB,
                          identity=TINY, page_format=MHA)  # no segment: a client closes 1 s faster without one
    raw.register_buffer(page.data_ptr(), NB)
    try:
        assert raw.batch_put_from(names, [page.data_ptr(), page.data_ptr() + half], [half, half]) == [0, 0]
        assert store.batch_exists([h]) == 1 and strict.batch_exists([h]) == 0
        buf = torch.zeros(NB, dtype=torch.uint8)
        assert store.batch_get([h], [buf]) == [True] and torch.equal(buf, page)
        assert store.stats().unverified == 1
        assert strict.batch_get([h], [buf]) == [False] and not buf.any()
        # first writer wins; its bytes are exactly this page's, so our seal is added (mooncake_owned)
        assert store.batch_set([h], [page]) == [True] and store.stats().resealed == 1
        assert strict.batch_exists([h]) == 1
    finally:
        strict.close()
        raw.unregister_buffer(page.data_ptr())


def test_unverified_pages_are_each_counted_and_warned_about_once_per_store(module_master, shared_store, raw):
    """Every page served without a seal is counted ``unverified``; the store warns once, naming
    the first such page (docs/storage.md: one warning per store)."""
    hs = fresh_hashes(3)
    pool = pages(3, seed=6)
    half = NB // 2
    raw.register_buffer(pool.data_ptr(), pool.numel())
    s = open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB, identity=TINY, page_format=MHA)
    try:
        for h, page in zip(hs, pool):
            names = sglang_keys(h, "org/tiny", 1, mla=False)
            assert raw.batch_put_from(names, [page.data_ptr(), page.data_ptr() + half], [half, half]) == [0, 0]
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(3)]
        with capture_logs() as logs:
            assert s.batch_get(hs[:2], out[:2]) == [True, True]
            assert s.batch_get(hs[2:], out[2:]) == [True]
        assert all(torch.equal(o, p) for o, p in zip(out, pool)) and s.stats().unverified == 3
        warned = [{k: e.get(k) for k in ("event", "log_level", "name", "detail")}
                  for e in logs if e.get("event") == "mooncake.unverified_page"]
        assert warned == [{"event": "mooncake.unverified_page", "log_level": "warning", "name": f"org-tiny_{hs[0]}_1",
                           "detail": "page without a seal (written by SGLang?) served; require_checksum=1 refuses them"}]
    finally:
        s.close()
        raw.unregister_buffer(pool.data_ptr())


def test_mla_pages_are_one_object(mooncake_master, raw):
    fmt = PageFormat.of("page_first", torch.bfloat16, (PS, LAYERS, 1, 16))
    nb = PS * LAYERS * 16 * 2
    s = open_storage(mooncake_master.spec(), page_nbytes=nb, identity=DeploymentIdentity(model_name="org/tiny", mla=True),
                     page_format=fmt)
    try:
        assert s.naming.mla
        h = fresh_hashes(1)[0]
        page = torch.arange(nb, dtype=torch.int32).to(torch.uint8)
        assert s.batch_set([h], [page]) == [True]
        assert raw.batch_is_exist([f"org-tiny_{h}__k", f"org-tiny_{h}__v"]) == [1, 0]
        out = torch.zeros(nb, dtype=torch.uint8)
        assert s.batch_get([h], [out]) == [True] and torch.equal(out, page)
    finally:
        s.close()


# --- deployments sharing a store with SGLang's MooncakeStore -------------------------------------

class SGLangNode:
    """One SGLang rank's MooncakeStore data path (``batch_set_v1`` / ``batch_get_v1``) over its own
    host pool: names from ``MooncakeStoreNames``, pointers from the pool's ``get_page_buffer_meta``
    (both verbatim SGLang 0.5.19), bytes moved by a raw Mooncake client."""

    def __init__(self, raw, host, layout: str, *, model: str, tp=(0, 1), pp=(0, 1), cp=(0, 1), tag=None):
        self.raw, self.pool = raw, sglang_pool(host, layout, pages=2)
        config = storage_config_from_controller(
            tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_group_rank_size=cp,
            is_mla=host.mla, layout=layout, model_name=model,
            extra_config=None if tag is None else {"extra_backend_tag": tag})
        self.names = MooncakeStoreNames(config)
        self.page_size = host.page_size

    def _meta(self, page: int):
        return self.pool.get_page_buffer_meta(torch.arange(page * self.page_size, (page + 1) * self.page_size))

    def _io(self, fn, h: str, page: int) -> list[int]:
        buf = self.pool.kv_buffer
        self.raw.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
        try:
            ptrs, sizes = self._meta(page)
            return fn(self.names.set_keys([h]), ptrs, sizes)
        finally:
            self.raw.unregister_buffer(buf.data_ptr())

    def put(self, h: str, page: int) -> list[int]:
        return self._io(self.raw.batch_put_from, h, page)

    def get(self, h: str, page: int) -> list[int]:
        return self._io(self.raw.batch_get_into, h, page)

    def exists(self, h: str) -> list[int]:
        return self.raw.batch_is_exist(self.names.exists_keys([h]))


def _share_both_ways(stack, node: SGLangNode) -> None:
    """Our page read right by SGLang, SGLang's page read right by us."""
    host = stack.host_pool
    mine, theirs = fresh_hashes(2)
    assert stack.storage.batch_set([mine], [host.page_bytes(0)]) == [True]
    assert node.exists(mine) == [1] * host.buffer.shape[1]
    assert all(c > 0 for c in node.get(mine, 1)) and same_kv(host, 0, node.pool, 1)
    fill_random(node.pool, seed=11)
    assert node.put(theirs, 0) == [0] * host.buffer.shape[1]
    assert stack.storage.batch_exists([theirs]) == 1
    assert stack.storage.batch_get([theirs], [host.page_bytes(1)]) == [True] and same_kv(host, 1, node.pool, 0)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("pp,cp", [((1, 2), (0, 1)), ((0, 1), (1, 2))], ids=["pp2", "cp2"])
def test_pp_and_cp_deployments_share_pages_both_ways_with_sglang(module_master, raw, mla, pp, cp):
    """No URL options beyond the master's address: the stack's identity names the objects."""
    stack = build_stack(LAYERS, HEADS if not mla else 1, DIM if not mla else 24, torch.bfloat16, PS, 16, 16, 1, 16,
                        storage=f"mooncake://{module_master.address}", mla=mla, model_name="org/m", tp_rank=1,
                        tp_size=2, pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=cp[0], attn_cp_size=cp[1])
    try:
        host = stack.host_pool
        host.buffer.copy_(random_host(LAYERS, HEADS, host.buffer.shape[-1], PS, 4, mla).buffer)
        _share_both_ways(stack, SGLangNode(raw, host, "page_first", model="org/m", tp=(1, 2), pp=pp, cp=cp))
    finally:
        stack.close()


def test_a_context_parallel_rank_never_serves_another_cp_ranks_page(module_master, shared_store):
    """SGLang names CP ranks' objects alike (first writer wins); our seal names the CP rank."""
    one = DeploymentIdentity(model_name="org/m", attn_cp_rank=1, attn_cp_size=2)
    zero = open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB, identity=one.replace(attn_cp_rank=0),
                        page_format=MHA)
    other = open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB, identity=one, page_format=MHA)
    try:
        h = fresh_hashes(1)[0]
        page = pages(1, seed=3)[0]
        assert zero.batch_set([h], [page]) == [True]
        buf = torch.zeros(NB, dtype=torch.uint8)
        assert other.batch_get([h], [buf]) == [False] and other.stats().foreign == 1 and not buf.any()
        assert zero.batch_get([h], [buf]) == [True] and torch.equal(buf, page)
    finally:
        zero.close(), other.close()


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_a_node_in_another_layout_shares_right_kv_and_page_first_readers_refuse_it(module_master, raw, layout):
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 16, 16, 1, 16, storage=module_master.spec(),
                        model_name="org/m", backend_tag="t1", host_layout=layout)
    first = open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB,
                         identity=stack.identity.replace(layout="page_first"), page_format=MHA)
    try:
        stack.host_pool.buffer.copy_(random_host(LAYERS, HEADS, DIM, PS, 4, False).buffer)
        node = SGLangNode(raw, stack.host_pool, layout, model="org/m", tag="t1")
        _share_both_ways(stack, node)
        h = fresh_hashes(1)[0]  # a page_first reader of the same names: same size, other byte order
        assert stack.storage.batch_set([h], [stack.host_pool.page_bytes(2)]) == [True]
        buf = torch.zeros(NB, dtype=torch.uint8)
        assert first.batch_get([h], [buf]) == [False] and first.stats().foreign == 1 and not buf.any()
    finally:
        first.close()
        stack.close()


def test_identity_options_in_the_url_name_the_objects(module_master, shared_store, raw):
    spec = module_master.spec(global_segment_size=0, model="org/x", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2,
                              backend_tag="t")
    s = open_storage(spec, page_nbytes=NB, page_format=MHA)
    try:
        assert s.identity == DeploymentIdentity(model_name="org/x", backend_tag="t", tp_rank=1, tp_size=2, pp_rank=1,
                                                pp_size=2)
        h = fresh_hashes(1)[0]
        assert s.batch_set([h], [pages(1)[0]]) == [True]
        assert raw.batch_is_exist([f"t_org-x_{h}_1_1_k", f"t_org-x_{h}_1_1_v"]) == [1, 1]
    finally:
        s.close()


# --- integrity ------------------------------------------------------------------------------------

def _replace(raw, name: str, data: torch.Tensor) -> None:
    """Swap one stored object for ``data`` (Mooncake's put keeps an existing value)."""
    raw.remove(name, True)
    raw.register_buffer(data.data_ptr(), data.numel())
    assert raw.batch_put_from([name], [data.data_ptr()], [data.numel()]) == [0]
    raw.unregister_buffer(data.data_ptr())


def test_changed_bytes_are_a_counted_miss_and_never_removed(store, raw):
    h = fresh_hashes(1)[0]
    page = pages(1, seed=1)[0]
    store.batch_set([h], [page])
    v_name = sglang_keys(h, "org/tiny", 1, mla=False)[1]
    bad = page[NB // 2:].clone()
    bad[3] ^= 0x80
    bad[100] ^= 0x80  # two sign-bit flips: what the old weighted sum missed
    _replace(raw, v_name, bad)
    buf = torch.full((NB,), 7, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [False] and not buf.any()  # nothing of it left behind
    assert store.stats().corrupt == 1
    # bytes that fail our seal are not provably ours (another writer's page after an eviction): kept
    assert raw.batch_is_exist(sglang_keys(h, "org/tiny", 1, mla=False) + [f"org-tiny_{h}_1_kvlp"]) == [1, 1, 1]
    assert store.batch_get([h], [buf]) == [False] and store.stats().corrupt == 2  # still never served


def test_renamed_and_foreign_format_pages_are_misses(store, raw, mooncake_master):
    a, b = fresh_hashes(2)
    page = pages(1, seed=2)[0]
    store.batch_set([a], [page])
    # copy a's objects and seal under b's names (a page renamed onto another key)
    for src, dst in zip(sglang_keys(a, "org/tiny", 1, False) + [f"org-tiny_{a}_1_kvlp"],
                        sglang_keys(b, "org/tiny", 1, False) + [f"org-tiny_{b}_1_kvlp"]):
        size = raw.get_size(src)
        tmp = torch.zeros(size, dtype=torch.uint8)
        raw.register_buffer(tmp.data_ptr(), size)
        assert raw.batch_get_into([src], [tmp.data_ptr()], [size]) == [size]
        raw.unregister_buffer(tmp.data_ptr())
        _replace(raw, dst, tmp)
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([b], [buf]) == [False] and store.stats().foreign == 1
    # the same bytes written by a deployment of another dtype under the same names
    fp16 = open_storage(mooncake_master.spec(global_segment_size=0), page_nbytes=NB, identity=TINY,
                        page_format=PageFormat.of("page_first", torch.float16, MHA.shape))
    try:
        c = fresh_hashes(1)[0]
        assert fp16.batch_set([c], [page]) == [True]
        assert store.batch_get([c], [buf]) == [False] and store.stats().foreign == 2
        assert fp16.batch_get([c], [buf]) == [True] and torch.equal(buf, page)
    finally:
        fp16.close()


def test_an_object_of_another_size_is_a_miss(store, raw):
    h = fresh_hashes(1)[0]
    k_name, v_name = sglang_keys(h, "org/tiny", 1, False)
    for name, n in ((k_name, NB // 2), (v_name, NB // 2 + 8)):  # V too big for our buffer
        _replace(raw, name, torch.ones(n, dtype=torch.uint8))
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [False] and store.stats().wrong_size == 1 and not buf.any()


# --- specs and bad input --------------------------------------------------------------------------

def test_spec_parsing():
    s = parse_spec("mooncake://127.0.0.1:5000?replica_num=2&global_segment_size=1GiB&lazy=1")
    assert (s.master, s.replica_num, s.global_segment_size, s.lazy) == ("127.0.0.1:5000", 2, 1 << 30, True)
    assert parse_spec("mooncake://[::1]:7").master == "[::1]:7" and parse_size("64MB") == 64 << 20
    flags = parse_spec("mooncake://h:1?lazy=TRUE&require_checksum=Yes&seal=off")
    assert (flags.lazy, flags.require_checksum, flags.seal) == (True, True, False)  # any case
    for bad in ("mooncake://127.0.0.1", "mooncake://h:1?bogus=1", "mooncake://h:1?replica_num=0",
                "mooncake://h:1?global_segment_size=lots", "mooncake://h:1/x", "mooncake://h:1?lazy=maybe",
                "mooncake://h:1?protocol=udp", "mooncake://h:1?exists_timeout_s=-1", "mooncake://h:1?setup_timeout_s=0",
                "mooncake://h:1?model=org/m"):  # identity options belong to open_storage
        with pytest.raises(StorageConfigError):
            parse_spec(bad)


def test_nothing_listening_is_a_fast_one_line_error():
    require_mooncake()
    spec = f"mooncake://127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(StorageUnavailable) as err:
        open_storage(spec, page_nbytes=NB, identity=M)
    assert time.monotonic() - t < 2.0
    assert "\n" not in str(err.value) and "unreachable" in str(err.value) and spec[len("mooncake://"):] in str(err.value)


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as without the wheel
    with pytest.raises(StorageUnavailable, match=r"kv-lifecycle\[mooncake\]") as err:
        open_storage("mooncake://127.0.0.1:1", page_nbytes=NB, identity=M)
    assert EXTRA_HINT in str(err.value)


def test_bad_input_changes_nothing(store, raw):
    h = fresh_hashes(2)
    p = pages(2)
    for keys, bufs, exc in (([h[0], "../x"], [p[0], p[1]], InvalidKey), ([h[0], h[1]], [p[0]], ValueError),
                            ([h[0], h[1]], [p[0], p[1][:-1]], PageSizeMismatch)):
        with pytest.raises(exc):
            store.batch_set(keys, bufs)
        with pytest.raises(exc):
            store.batch_get(keys, bufs)
    with pytest.raises(InvalidKey):
        store.batch_exists([h[0], "nope"])
    with pytest.raises(InvalidKey):
        store.delete("NOPE")
    assert raw.batch_is_exist(sglang_keys(h[0], "org/tiny", 1, False)) == [0, 0]
    assert store.stats().stored == 0


def test_exists_counts_the_longest_stored_prefix_and_delete_reports(store):
    h = fresh_hashes(4)
    p = pages(4)
    assert store.batch_set([h[0], h[1], h[3]], [p[0], p[1], p[3]]) == [True] * 3
    assert store.batch_exists(h) == 2
    assert store.delete(h[1]) is True and store.delete(h[1]) is False
    assert store.batch_exists(h) == 1
    assert store.batch_get(h[:2], [p[2].clone(), p[2].clone()]) == [True, False]


class Wrapped:
    """A real client with some of its calls replaced (set as attributes)."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)


def tier_down_errors(logs) -> list:
    return [e["error"] for e in logs if e.get("event") == "storage.tier_down"]


def test_exists_of_no_keys_is_zero_and_an_unconnected_store_says_which_call_it_refused():
    require_mooncake()
    s = open_storage(f"mooncake://127.0.0.1:{free_port()}?lazy=1", page_nbytes=NB, identity=M, page_format=MHA)
    try:
        assert s.batch_exists([]) == 0
        with pytest.raises(StorageUnavailable, match=r"^mooncake storage at mooncake://127\.0\.0\.1:\d+ is unavailable \(exists\)$"):
            s.batch_exists(fresh_hashes(1))
        assert s.stats().unavailable == 1
    finally:
        s.close(wait=True)


@pytest.fixture
def own_store(module_master, shared_store):
    """A store of its own (the test opens its breaker), placing objects on the module store's segment."""
    s = open_storage(module_master.spec(global_segment_size=0, exists_timeout_s=0.2), page_nbytes=NB, identity=TINY,
                     page_format=MHA)
    yield s
    s.close(wait=True)


def test_a_master_gone_at_the_existence_check_is_a_typed_error_naming_the_step(own_store, monkeypatch):
    client = Wrapped(own_store._store)
    client.batch_is_exist = lambda names: [-900] * len(names)  # RPC_FAIL
    monkeypatch.setattr(own_store, "_store", client)
    with capture_logs() as logs, pytest.raises(StorageUnavailable, match=r"^mooncake storage at \S+ is unreachable \(exists\)$"):
        own_store.batch_exists(fresh_hashes(2))
    assert tier_down_errors(logs) == ["exists: RPC_FAIL(-900)"]


def test_a_hung_existence_check_times_out_and_the_next_fails_fast_while_it_still_runs(own_store, monkeypatch):
    """``exists_timeout_s`` (0.2 s here) bounds a check; the breaker opens; once it lets a probe
    through, a check while the hung one still runs fails at once; each counted ``unavailable``."""
    released = threading.Event()
    client = Wrapped(own_store._store)

    def hung(names):
        released.wait(3.0)  # a master that accepted the call and does not answer
        return client._client.batch_is_exist(names)

    client.batch_is_exist = hung
    monkeypatch.setattr(own_store, "_store", client)
    base = own_store.stats().unavailable
    try:
        with capture_logs() as logs:
            t = time.monotonic()
            with pytest.raises(StorageUnavailable, match=r"^mooncake storage at \S+: existence check exceeded 0\.2 s$"):
                own_store.batch_exists(fresh_hashes(1))
            assert time.monotonic() - t < 1.0 and own_store.stats().unavailable == base + 1
        assert tier_down_errors(logs) == ["existence check exceeded 0.2 s"]
        time.sleep(max(0.0, own_store.breaker.retry_in()) + 0.05)  # half-open: the next call is a probe
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match=r"^mooncake storage at \S+: an existence check is still running$"):
            own_store.batch_exists(fresh_hashes(1))
        assert time.monotonic() - t < 0.5 and own_store.stats().unavailable == base + 2
    finally:
        released.set()


def test_a_seal_object_of_another_size_is_a_corrupt_miss_logged_by_page_name(own_store, raw):
    """A store of its own: ``mooncake.page_refused`` is rate-limited per store."""
    h = fresh_hashes(1)[0]
    page = pages(1, seed=7)[0]
    assert own_store.batch_set([h], [page]) == [True]
    _replace(raw, f"org-tiny_{h}_1_kvlp", torch.ones(50, dtype=torch.uint8))  # not our 104-byte seal
    buf = page.clone()
    with capture_logs() as logs:
        assert own_store.batch_get([h], [buf]) == [False]
    assert not buf.any() and own_store.stats().corrupt == 1
    assert raw.batch_is_exist(sglang_keys(h, "org/tiny", 1, False)) == [1, 1]  # nothing removed
    refused = [{k: e.get(k) for k in ("event", "log_level", "name", "verdict")}
               for e in logs if e.get("event") == "mooncake.page_refused"]
    assert refused == [{"event": "mooncake.page_refused", "log_level": "error", "name": f"org-tiny_{h}_1",
                        "verdict": "corrupt"}]


def test_setup_noise_is_dropped_and_every_other_stderr_line_kept():
    """Issue 21: the two lines Mooncake's client prints on every healthy start are dropped; anything
    else written to file descriptor 2 meanwhile (a real setup error) still reaches stderr, in order.
    Run in a child process whose fd 2 is a pipe we read."""
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent('''
        import os
        from transfer.storage.mooncake.conn import setup_noise_dropped
        with setup_noise_dropped():
            os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\\n")
            os.write(2, b"E1201 18:28:08.365532  8881 transfer_metadata.cpp:1098] Local segment descriptor not found\\n")
            os.write(2, b"E1201 18:28:09.000001  8881 real_client.cpp:77] Failed to connect to master\\n")
        os.write(2, b"after\\n")
    ''')
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b"E1201 18:28:09.000001  8881 real_client.cpp:77] Failed to connect to master\nafter\n"


def test_writes_and_deletes_are_announced_once(shared_store):
    from transfer.kv_events import EXTERNAL, medium_of
    from transfer.kv_events.announcer import TierAnnouncer

    log = []

    class Recorder:
        def stored(self, medium, hashes, tokens, block_size, parent=None):
            log.append(("stored", medium, list(hashes), list(tokens), parent))

        def removed(self, medium, hashes):
            log.append(("removed", medium, list(hashes)))

    h = fresh_hashes(3)
    pool = pages(3, seed=5)
    shared_store.events = TierAnnouncer(Recorder(), medium_of(shared_store), page_size=PS)
    try:
        with shared_store.events.writing(h[:2], list(range(2 * PS)), None):
            assert shared_store.batch_set(h[:2], [pool[0], pool[1]]) == [True, True]
        assert shared_store.batch_set(h, [pool[0], pool[1], pool[2]]) == [True] * 3   # two already there
        assert shared_store.delete(h[0])
    finally:
        shared_store.events = None
    assert log == [("stored", EXTERNAL, [h[0]], list(range(PS)), None),
                   ("stored", EXTERNAL, [h[1]], list(range(PS, 2 * PS)), h[0]),
                   ("stored", EXTERNAL, [h[2]], [], None),
                   ("removed", EXTERNAL, [h[0]])]

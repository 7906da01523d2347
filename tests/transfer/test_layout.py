"""Pages stored in SGLang's host layouts: the bytes a tier holds for page_first, page_first_direct
and page_head are what SGLang 0.5.19's own host pools (``get_data_page`` / ``set_from_flat_data_page``,
copied verbatim into ``tests/data/sglang_0_5_19.py``) write and read, so an SGLang node of that
layout reads the right KV for every token and layer; the layout is in the seal, so our readers
never serve a page of another layout."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import weakref

import pytest
import torch

from tests.data.sglang_0_5_19 import MHAHostPool, MLAHostPool
from tests.support.sglang_pages import random_host, same_kv
from transfer import build_stack
from transfer.errors import PageSizeMismatch, StorageConfigError
from transfer.host_pool import HostPool
from transfer.stack import page_format
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.integrity import PageFormat
from transfer.storage.layout import LayoutStorage, PageOrder, seal_layout, stored_in_layout, wire_format
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import open_storage

PS, LAYERS, HEADS, DIM, W = 4, 3, 2, 8, 24
MHA_LAYOUTS = ["page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["page_first", "page_first_direct"]
H1, H2, H3 = "ab" * 32, "cd" * 32, "ef" * 32


def _host(mla: bool, dtype=torch.bfloat16, pages: int = 4) -> HostPool:
    return random_host(LAYERS, HEADS, W if mla else DIM, PS, pages, mla, dtype)


def _sglang_pool(layout: str, mla: bool, dtype, pages: int = 4):
    if mla:
        return MLAHostPool(layout, pages * PS, PS, LAYERS, W, dtype)
    return MHAHostPool(layout, pages * PS, PS, LAYERS, HEADS, DIM, dtype)


@pytest.mark.parametrize("mla,layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_page_order_is_sglangs_host_page_both_ways(mla, layout, dtype):
    host = _host(mla, dtype)
    order = PageOrder(layout, page_format(host).shape, host.buffer.element_size())
    stored = torch.empty(host.page_nbytes, dtype=torch.uint8)
    order.to_layout(host.page_bytes(1), stored)
    pool = _sglang_pool(layout, mla, dtype)
    pool.set_from_flat_data_page(2 * PS, stored.view(dtype))  # what SGLang does with a loaded page
    assert same_kv(host, 1, pool, 2)
    # and what SGLang writes (get_data_page) comes back to the same host page
    back = torch.zeros(host.page_nbytes, dtype=torch.uint8)
    order.to_host(pool.get_data_page(2 * PS, flat=True).contiguous().view(torch.uint8), back)
    assert torch.equal(back, host.page_bytes(1))
    assert torch.equal(stored, pool.get_data_page(2 * PS, flat=True).contiguous().view(torch.uint8))


def test_mooncake_blocks_are_get_page_buffer_meta_spans():
    """Each half of a stored MHA page is the span SGLang's get_page_buffer_meta points K / V at."""
    host = _host(False)
    for layout in MHA_LAYOUTS:
        order = PageOrder(layout, page_format(host).shape, 2)
        pool = _sglang_pool(layout, False, torch.bfloat16)
        stored = torch.empty(host.page_nbytes, dtype=torch.uint8)
        order.to_layout(host.page_bytes(0), stored)
        pool.set_from_flat_data_page(PS, stored.view(torch.bfloat16))
        (k_ptr, v_ptr), sizes = pool.get_page_buffer_meta(torch.arange(PS, 2 * PS))
        base = pool.kv_buffer.data_ptr()
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        half = host.page_nbytes // 2
        assert sizes == [half, half]
        assert torch.equal(flat[k_ptr - base:k_ptr - base + half], stored[:half])
        assert torch.equal(flat[v_ptr - base:v_ptr - base + half], stored[half:])


def test_wire_format_names_the_layout_in_the_seal():
    host = _host(False)
    fmt = page_format(host)
    assert wire_format(fmt, "page_first") == fmt
    direct = wire_format(fmt, "page_first_direct")
    assert direct.layout == seal_layout("page_first_direct") and direct.shape == (2, LAYERS, PS, HEADS, DIM)
    assert wire_format(fmt, "page_head").shape == (2, HEADS, PS, LAYERS, DIM)
    with pytest.raises(StorageConfigError):
        wire_format(page_format(_host(True)), "page_head")
    with pytest.raises(StorageConfigError):
        wire_format(direct, "page_head")  # only page-first host pages are reordered


@pytest.mark.parametrize("mla,layout", [(False, "page_first_direct"), (False, "page_head"), (True, "page_first_direct")])
def test_file_pages_are_hicache_files_of_the_layout_both_ways(tmp_path, mla, layout):
    """What HiCacheFile in ``layout`` reads from our file is the right KV, and what it writes we read."""
    host = _host(mla)
    ident = DeploymentIdentity(model_name="org/m", mla=mla, layout=layout)
    store = open_storage(f"file:{tmp_path}", page_nbytes=host.page_nbytes, identity=ident, page_format=page_format(host))
    assert isinstance(store, LayoutStorage)
    assert store.batch_set([H1], [host.page_bytes(0)]) == [True]
    pool = _sglang_pool(layout, mla, torch.bfloat16)
    with open(tmp_path / ident.file_name(H1), "rb") as f:  # HiCacheFile.get: the raw file into a flat page
        pool.set_from_flat_data_page(PS, torch.frombuffer(bytearray(f.read()), dtype=torch.bfloat16))
    assert same_kv(host, 0, pool, 1)
    # HiCacheFile.set of its page 1: value.contiguous().view(uint8) of get_data_page
    with open(tmp_path / ident.file_name(H2), "wb") as f:
        f.write(pool.get_data_page(PS, flat=True).contiguous().view(torch.uint8).numpy().tobytes())
    into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
    assert store.batch_get([H2], [into]) == [True] and torch.equal(into, host.page_bytes(0))
    assert store.stats().unverified == 1
    into.zero_()
    assert store.batch_get([H1], [into]) == [True] and torch.equal(into, host.page_bytes(0))
    store.close()


def test_our_readers_never_serve_a_page_of_another_layout(tmp_path):
    host = _host(False)
    stores = {layout: open_storage(f"file:{tmp_path}", page_nbytes=host.page_nbytes,
                                   identity=DeploymentIdentity(model_name="m", layout=layout),
                                   page_format=page_format(host)) for layout in MHA_LAYOUTS}
    for i, (writer, store) in enumerate(stores.items()):
        key = f"{i:064x}"
        assert store.batch_set([key], [host.page_bytes(i)]) == [True]
        for reader, other in stores.items():
            into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
            before = other.stats().foreign
            got = other.batch_get([key], [into])
            if reader == writer:
                assert got == [True] and torch.equal(into, host.page_bytes(i))
            else:  # same names, same size, another byte order: refused, nothing left in the buffer
                assert got == [False] and not into.any() and other.stats().foreign == before + 1
    for store in stores.values():
        store.close()


def test_memory_tier_in_another_layout_round_trips_and_refuses_page_first_readers():
    host = _host(False)
    fmt = page_format(host)
    direct = open_storage("memory", page_nbytes=host.page_nbytes,
                          identity=DeploymentIdentity(layout="page_first_direct"), page_format=fmt)
    assert direct.batch_set([H1], [host.page_bytes(2)]) == [True]
    into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
    assert direct.batch_get([H1], [into]) == [True] and torch.equal(into, host.page_bytes(2))
    # the inner tier holds the page_first_direct bytes, sealed as such
    assert direct.inner.page_format == wire_format(fmt, "page_first_direct")


def test_batches_larger_than_the_staging_buffer_are_split(tmp_path):
    host = _host(False, pages=8)
    ident = DeploymentIdentity(model_name="m", layout="page_head")
    inner = open_storage(f"file:{tmp_path}", page_nbytes=host.page_nbytes, identity=ident.replace(layout="page_first"),
                         page_format=wire_format(page_format(host), "page_head"))
    store = LayoutStorage(inner, "page_head", page_format(host), staging_bytes=3 * host.page_nbytes)
    keys = [f"{i:064x}" for i in range(8)]
    assert store.batch_set(keys, [host.page_bytes(i) for i in range(8)]) == [True] * 8
    assert store.batch_exists(keys) == 8
    into = [torch.zeros(host.page_nbytes, dtype=torch.uint8) for _ in range(9)]
    assert store.batch_get(keys + ["9" * 64], into) == [True] * 8 + [False]
    assert all(torch.equal(into[i], host.page_bytes(i)) for i in range(8)) and not into[8].any()
    assert store.delete(keys[0]) and store.batch_exists(keys) == 0
    store.close()


def test_layout_needs_a_page_format_and_an_mla_page_needs_an_mla_identity(tmp_path):
    host = _host(False)
    with pytest.raises(StorageConfigError, match="page format"):
        open_storage("memory", page_nbytes=host.page_nbytes, identity=DeploymentIdentity(layout="page_head"))
    with pytest.raises(StorageConfigError, match="mla"):
        open_storage("memory", page_nbytes=host.page_nbytes, identity=DeploymentIdentity(mla=True),
                     page_format=page_format(host))
    with pytest.raises(StorageConfigError, match="MLA"):
        build_stack(2, 1, 16, torch.bfloat16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}", mla=True,
                    host_layout="page_head")
    assert os.listdir(tmp_path) == []  # refused before the tier opened


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_a_stack_in_a_layout_offloads_and_reloads_bit_exact(tmp_path, layout):
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 32, 32, 2, 32, storage=f"file:{tmp_path}",
                        model_name="org/m", host_layout=layout)
    try:
        assert stack.identity.layout == layout
        host = stack.host_pool
        host.buffer.view(-1).view(torch.uint8).copy_(_host(False, pages=8).buffer.view(-1).view(torch.uint8))
        assert stack.storage.batch_set([H3], [host.page_bytes(3)]) == [True]
        pool = _sglang_pool(layout, False, torch.bfloat16)
        with open(tmp_path / stack.identity.file_name(H3), "rb") as f:
            pool.set_from_flat_data_page(0, torch.frombuffer(bytearray(f.read()), dtype=torch.bfloat16))
        assert same_kv(host, 3, pool, 0)
    finally:
        stack.close()


def test_an_sglang_node_of_another_layout_loads_a_page_with_none_of_its_kv_right():
    """What docs/storage.md promises about mixed layouts (SGLang has no seal to refuse with):
    8 pages of 16 tokens written in one layout and loaded by SGLang in another hold 0 of 128
    tokens' K and V right, for each of the six ordered pairs."""
    layers, heads, dim, ps, pages = 4, 2, 8, 16, 8
    host = random_host(layers, heads, dim, ps, pages, False)
    for writer, reader in itertools.permutations(MHA_LAYOUTS, 2):
        order = PageOrder(writer, page_format(host).shape, 2)
        pool = MHAHostPool(reader, pages * ps, ps, layers, heads, dim, torch.bfloat16)
        right = 0
        for p in range(pages):
            stored = torch.empty(host.page_nbytes, dtype=torch.uint8)
            order.to_layout(host.page_bytes(p), stored)
            pool.set_from_flat_data_page(p * ps, stored.view(torch.bfloat16))
            view = host.page_view(p)
            right += sum(all(torch.equal(view[k, t, layer], pool.token_kv(p * ps + t, layer)[k])
                             for layer in range(layers) for k in (0, 1)) for t in range(ps))
        assert right == 0, (writer, reader)
        assert same_kv(host, 0, _reload(host, writer, pool), 0)  # the same pages in their own layout: all right


def _reload(host, layout, like):
    pool = MHAHostPool(layout, like.size, like.page_size, like.layer_num, like.head_num, like.head_dim, like.dtype)
    order = PageOrder(layout, page_format(host).shape, 2)
    stored = torch.empty(host.page_nbytes, dtype=torch.uint8)
    order.to_layout(host.page_bytes(0), stored)
    pool.set_from_flat_data_page(0, stored.view(torch.bfloat16))
    return pool


def _supported(err) -> list[str]:
    """The layouts an error message lists after ``supported:``."""
    return str(err.value).rsplit("supported: ", 1)[1].split(", ")


def test_an_unknown_layout_or_page_shape_is_named_with_what_is_supported():
    mha, mla = page_format(_host(False)), page_format(_host(True))
    with pytest.raises(StorageConfigError, match=r"host page is .*\(MHA\) or .*\(MLA\), got shape \(2, 3, 4\)"):
        wire_format(PageFormat("page_first", "bfloat16", (2, 3, 4)), "page_head")
    with pytest.raises(StorageConfigError, match="'page_head' is not supported for this page") as err:
        wire_format(mla, "page_head")
    assert _supported(err) == MLA_LAYOUTS
    with pytest.raises(StorageConfigError, match="'page_tail' is not supported") as err:
        wire_format(mha, "page_tail")
    assert _supported(err) == MHA_LAYOUTS
    with pytest.raises(StorageConfigError, match="unknown host layout 'page_tail'") as err:
        seal_layout("page_tail")
    assert _supported(err) == MHA_LAYOUTS
    with pytest.raises(StorageConfigError, match="page_first host pages, got layout 'page_head'"):
        wire_format(wire_format(mha, "page_head"), "page_first_direct")


class Recording(MemoryStorage):
    """A memory tier that records the batches it is handed (sizes, and the staging buffers)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sets, self.gets, self.buffers = [], [], []

    def batch_set(self, keys, pages):
        self.sets.append(len(keys))
        self.buffers += [(p.data_ptr(), weakref.ref(p._base)) for p in pages]
        return super().batch_set(keys, pages)

    def batch_get(self, keys, into):
        self.gets.append(len(keys))
        return super().batch_get(keys, into)


def _layout_store(staging_bytes=16 << 20):
    host = _host(False)
    fmt = page_format(host)
    inner = Recording("_m_0_1", host.page_nbytes, page_format=wire_format(fmt, "page_head"))
    return host, LayoutStorage(inner, "page_head", fmt, staging_bytes=staging_bytes), inner


def test_the_wrapper_is_a_tier_of_host_pages_over_an_inner_tier_of_the_layouts_format():
    host, store, inner = _layout_store()
    fmt = page_format(host)
    assert store.page_format == fmt and store.page_nbytes == host.page_nbytes
    with pytest.raises(StorageConfigError, match="inner tier's format"):
        LayoutStorage(MemoryStorage("_m_0_1", host.page_nbytes, page_format=fmt), "page_head", fmt)
    assert stored_in_layout(lambda f: MemoryStorage("", host.page_nbytes, page_format=f), "page_first",
                            fmt).page_format == fmt  # page_first: the tier itself, opened with the host format


def test_a_staging_buffer_under_one_page_still_moves_one_page_per_inner_call():
    host, store, inner = _layout_store(staging_bytes=_host(False).page_nbytes - 1)
    keys = [H1, H2, H3]
    assert store.batch_set(keys, [host.page_bytes(i) for i in range(3)]) == [True] * 3
    into = [torch.zeros(host.page_nbytes, dtype=torch.uint8) for _ in range(3)]
    assert store.batch_get(keys, into) == [True] * 3
    assert inner.sets == [1, 1, 1] and inner.gets == [1, 1, 1]
    assert all(torch.equal(into[i], host.page_bytes(i)) for i in range(3))


def test_one_staging_buffer_per_thread_reused_and_kept_until_the_store_is_closed():
    host, store, inner = _layout_store()
    store.batch_set([H1], [host.page_bytes(0)])
    store.batch_set([H2], [host.page_bytes(1)])
    t = threading.Thread(target=lambda: store.batch_set([H3], [host.page_bytes(2)]))
    t.start()
    t.join()
    gc.collect()
    (main1, _), (main2, _), (other, other_buf) = inner.buffers
    assert main1 == main2 and other != main1  # reused by its thread; each thread has its own
    assert other_buf() is not None  # the ended thread's buffer is kept (a tier may have registered it)
    store.close()


def test_a_page_of_the_wrong_size_is_refused_before_it_is_reordered():
    host, store, inner = _layout_store()
    assert store.batch_set([H1], [host.page_bytes(0)]) == [True]
    short = torch.zeros(host.page_nbytes - 2, dtype=torch.uint8)
    with pytest.raises(PageSizeMismatch):
        store.batch_set([H2], [short])
    with pytest.raises(PageSizeMismatch):
        store.batch_get([H1], [short])
    assert inner.sets == [1] and inner.gets == [] and not short.any()


# --- two deployments of other host layouts over one store (issue 35, item 1) ---------------------

def _shared_spec(tier: str, tmp_path, request) -> str:
    return f"file:{tmp_path}" if tier == "file" else request.getfixturevalue("redis_url")


def _drop_behind_our_back(tier: str, spec: str, ident: DeploymentIdentity, key: str) -> None:
    """The page vanishes without the store knowing (another process's eviction, an expiry)."""
    if tier == "file":
        os.unlink(os.path.join(spec[len("file:"):], ident.file_name(key)))
    else:
        import redis
        c = redis.Redis.from_url(spec)
        assert c.delete(key + ident.file_suffix) == 1
        c.close()


@pytest.mark.parametrize("tier", ["file", "redis"])
def test_two_deployments_of_other_host_layouts_never_destroy_each_others_pages(tier, tmp_path, request):
    """Same page names (as SGLang's), another host layout: each deployment reads every page of its
    own, bit-exact; the other's pages under the same names are ``foreign`` misses (counted), and a
    write, an eviction or a delete of such a name leaves the other's page as it is (a write
    reports it stored — already there — counted ``foreign_kept``). Before, the second writer
    replaced the first's pages (file: ``os.replace``; Redis: "repaired") and it read 0/4."""
    spec = _shared_spec(tier, tmp_path, request)
    hosts = {"page_head": random_host(LAYERS, HEADS, DIM, PS, 8, False, seed=1),
             "page_first": random_host(LAYERS, HEADS, DIM, PS, 8, False, seed=2)}
    nb = hosts["page_head"].page_nbytes
    idents = {layout: DeploymentIdentity(model_name="m", layout=layout) for layout in hosts}

    def deployment(layout: str, **kw):
        return open_storage(spec, page_nbytes=nb, identity=idents[layout], page_format=page_format(hosts[layout]), **kw)

    def reads(store, layout: str, idx) -> list[bool]:
        into = [torch.zeros(nb, dtype=torch.uint8) for _ in idx]
        got = store.batch_get([hs[i] for i in idx], into)
        for ok, buf, i in zip(got, into, idx):  # served: its own page bit-exact; refused: nothing left
            assert torch.equal(buf, hosts[layout].page_bytes(i)) if ok else not buf.any()
        return got

    head, first = deployment("page_head"), deployment("page_first")
    hs = [os.urandom(32).hex() for _ in range(8)]
    assert head.batch_set(hs[:4], [hosts["page_head"].page_bytes(i) for i in range(4)]) == [True] * 4
    # page_first writes 4 pages, two of them under names page_head holds: already there, not replaced
    assert first.batch_set(hs[2:6], [hosts["page_first"].page_bytes(i) for i in range(2, 6)]) == [True] * 4
    assert (first.stats().stored, first.stats().foreign_kept) == (2, 2)
    assert reads(head, "page_head", range(4)) == [True] * 4
    assert reads(first, "page_first", range(2, 6)) == [False, False, True, True] and first.stats().foreign == 2
    # and the other way round
    assert head.batch_set(hs[4:6], [hosts["page_head"].page_bytes(i) for i in (4, 5)]) == [True, True]
    assert head.stats().foreign_kept == 2 and reads(first, "page_first", [4, 5]) == [True, True]
    # a delete of a name the other holds removes nothing
    assert first.delete(hs[2]) is False and head.delete(hs[4]) is False
    assert (first.stats().foreign_kept, head.stats().foreign_kept) == (3, 3)
    assert reads(head, "page_head", [2]) == [True] and reads(first, "page_first", [4]) == [True]
    # an eviction of a name that now holds the other's page: page_first (one page of room) wrote
    # hs[6]; it vanished behind its back and page_head wrote its own hs[6]; page_first's next
    # write evicts hs[6] from its index, and leaves page_head's page there (a file store opened
    # with that bound evicts its own deployment's pages at start, never page_head's)
    small = deployment("page_first", capacity_bytes=nb)
    assert small.batch_set([hs[6]], [hosts["page_first"].page_bytes(6)]) == [True]
    _drop_behind_our_back(tier, spec, idents["page_first"], hs[6])
    assert head.batch_set([hs[6]], [hosts["page_head"].page_bytes(6)]) == [True]
    assert small.batch_set([hs[7]], [hosts["page_first"].page_bytes(7)]) == [True]
    assert small.stats().evictions >= 1 and small.stats().foreign_kept >= 1
    assert reads(head, "page_head", [0, 1, 2, 3, 6]) == [True] * 5  # file: also not indexed at small's start
    for s in (head, first, small):
        s.close()

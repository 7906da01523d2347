"""vLLM's per-layer KV tensors as SGLang host pages (``lifecycle.integrations.vllm.layout``).

The promise: for the same tokens and the same KV, a page read out of vLLM's blocks is byte for byte
the page our SGLang drop-in stores (its stored file, under the same chain name), for the CPU
backend's head-major row split and FlashAttention's token-major channel split, with and without
kernel blocks; pages written back land where vLLM's kernels read them; what cannot be laid out the
same is refused in one typed line. The tensors are made as vLLM's ``allocate_kv_cache`` makes them
and read/written as its kernels address them (``lifecycle_tools.testkit.vllm_kv``); the real
allocator's tensors are checked in ``test_real_scheduler.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from hashing import page_hashes
from lifecycle import ConfigError
from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
from lifecycle.integrations.vllm.errors import VllmLayoutError
from lifecycle.integrations.vllm.layout import VllmKVLayout, layer_index
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from lifecycle_tools.testkit.vllm_kv import make_kv_caches, read_kv, write_kv
from tests.integrations.sglang_kit import Node, doubles_kit, hicache_file_get, hicache_file_suffix
from transfer import build_stack

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8
SPLITS = [("rows", 1), ("channels", 1), ("rows", 2), ("channels", 2)]
SPLIT_IDS = ["cpu-rows", "fa-channels", "cpu-rows-kernel-blocks", "fa-channels-kernel-blocks"]


def _caches(split, ratio, blocks=12, dtype=torch.bfloat16, layers=LAYERS, names=None):
    return make_kv_caches(split, layers, blocks * ratio, HEADS, PS // ratio, DIM, dtype, names=names)


def _random_kv(blocks, dtype=torch.bfloat16, seed=0, layers=LAYERS):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, layers, blocks * PS, HEADS, DIM), generator=gen).to(dtype)


def _slots(blocks):
    return (torch.tensor(blocks).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)


@pytest.mark.parametrize("split,ratio", SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_block_is_the_host_page_the_transfer_stack_copies_for_the_same_kv(split, ratio, dtype):
    kv = _random_kv(12, dtype)
    caches = _caches(split, ratio, dtype=dtype)
    write_kv(caches, split, kv)
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    assert (layout.layers, layout.heads, layout.head_dim, layout.num_blocks, layout.kv_split) == (
        LAYERS, HEADS, DIM, 12, split)
    # the transfer stack's own copy of the same KV: SGLang's device layout -> page-first host pages
    stack = build_stack(LAYERS, HEADS, DIM, dtype, PS, 12 * PS, 8 * PS, 2, 64)
    try:
        slots = torch.arange(12 * PS) + PS          # the stack's pool has a padding page first
        stack.kv_pool.write(slots, kv)
        blocks = [7, 2, 9, 3]
        host = stack.host_pool
        stack.offloader.engine.to_host("t", stack.kv_pool, host, _slots(blocks) + PS, torch.tensor([0, 1, 2, 3]))
        stack.offloader.engine.close()
        pages = layout.page_bytes_of(blocks)
        assert pages.shape == (4, 2, PS, LAYERS, HEADS, DIM) and pages.dtype == dtype
        for i in range(4):
            assert pages[i].reshape(-1).view(torch.uint8).numpy().tobytes() == (
                host.page_bytes(i).numpy().tobytes())
        assert layout.page_nbytes == host.page_nbytes
        # straight into a host pool, scattered pages (two runs)
        mine = layout.host_pool(8 * PS, pin=False)
        layout.to_host(blocks, mine, [5, 6, 0, 1])
        for i, page in enumerate([5, 6, 0, 1]):
            assert torch.equal(mine.page_bytes(page), host.page_bytes(i))
    finally:
        stack.close()


@pytest.mark.parametrize("split,ratio", SPLITS, ids=SPLIT_IDS)
def test_pages_written_back_land_where_vllms_kernels_read_them(split, ratio):
    kv = _random_kv(12, seed=3)
    src = _caches(split, ratio)
    write_kv(src, split, kv)
    pages = VllmKVLayout.from_kv_caches(src, PS).page_bytes_of([4, 0, 11])
    dst = _caches(split, ratio)
    into = VllmKVLayout.from_kv_caches(dst, PS)
    into.write_pages([1, 2, 3], pages)
    got = read_kv(dst, split, DIM)
    want = kv[:, :, _slots([4, 0, 11])]
    assert torch.equal(got[:, :, _slots([1, 2, 3])].view(torch.int16), want.view(torch.int16))
    assert not got[:, :, _slots([0, 4, 5, 11])].view(torch.int16).any()   # nothing else written
    # raw page bytes (as a storage tier returns them) and a host pool, the same
    raw = [p.reshape(-1).view(torch.uint8).clone() for p in pages]
    dst2 = _caches(split, ratio)
    VllmKVLayout.from_kv_caches(dst2, PS).write_pages([6, 7, 8], raw)
    assert torch.equal(read_kv(dst2, split, DIM)[:, :, _slots([6, 7, 8])].view(torch.int16), want.view(torch.int16))
    host = into.host_pool(4 * PS, pin=False)
    into.to_host([1, 2, 3], host, [3, 0, 1])
    dst3 = _caches(split, ratio)
    VllmKVLayout.from_kv_caches(dst3, PS).from_host(host, [3, 0, 1], [9, 10, 11])
    assert torch.equal(read_kv(dst3, split, DIM)[:, :, _slots([9, 10, 11])].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("split,ratio", SPLITS[:2], ids=SPLIT_IDS[:2])
def test_same_tokens_and_kv_give_the_same_names_and_bytes_as_the_sglang_drop_in_stores(tmp_path, monkeypatch,
                                                                                      split, ratio):
    """Our SGLang drop-in (doubles of SGLang's pools) decodes a request and stores its pages as
    HiCacheFile files; vLLM blocks holding the same tokens' KV (scattered, as vLLM's block pool hands
    them out) give the same bytes under the chain names of the same tokens."""
    store = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    node = Node(doubles_kit(), page_size=PS, layers=LAYERS, heads=HEADS, dim=DIM)
    with use_runtime(runtime_context(page_size=PS, model="org/M")):
        mgr = DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                          tp_group=None, tree_cache=node.tree)
    prompt = list(range(100, 110))
    req = node.admit("r", prompt, 13)
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    tokens = list(req.origin_input_ids) + list(req.output_ids[:-1])   # every token with KV
    suffix = hicache_file_suffix("org/M", 0, 1, False)
    files = sorted(os.listdir(store))
    assert files
    # vLLM: the same tokens' KV in scattered blocks, named by the same chain
    n_blocks = len(tokens) // PS
    blocks = [(5 * i + 3) % 17 for i in range(n_blocks)]
    kv = torch.zeros((2, LAYERS, 17 * PS, HEADS, DIM), dtype=torch.bfloat16)
    expected = node.expected["r"]                               # [positions, kinds, layers, heads, dim]
    for i, b in enumerate(blocks):
        kv[:, :, b * PS:(b + 1) * PS] = expected[i * PS:(i + 1) * PS].permute(1, 2, 0, 3, 4)
    caches = _caches(split, ratio, blocks=17)
    write_kv(caches, split, kv)
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    names = page_hashes(tokens, PS)
    stored = {f"{h}{suffix}.bin" for h in names}
    assert set(files) <= stored and len(files) == n_blocks - len(prompt) // PS   # decode pages: SGLang's own
    pages = layout.page_bytes_of(blocks)
    checked = 0
    for i, h in enumerate(names):
        data = hicache_file_get(str(store), h, suffix, layout.page_nbytes)
        if data is not None:
            assert pages[i].reshape(-1).view(torch.uint8).numpy().tobytes() == data
            checked += 1
    assert checked == len(files)
    mgr.release_host_resources()


def test_layers_are_laid_out_in_layer_index_order_whatever_the_dict_order():
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]
    kv = _random_kv(4, seed=5)
    caches = make_kv_caches("rows", LAYERS, 4, HEADS, PS, DIM, torch.bfloat16, names=names)
    # write_kv writes layer i into the i-th name: KV of layer 2 in the first tensor, ...
    write_kv(caches, "rows", kv[:, [2, 0, 1]])
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    assert layout.layer_names == sorted(names, key=layer_index)
    page = layout.page_bytes_of([1])[0]                         # [2, ps, layers, heads, dim]
    assert torch.equal(page.permute(0, 2, 1, 3, 4).view(torch.int16), kv[:, :, PS:2 * PS].view(torch.int16))


def _refused(caches, match, **kw):
    with pytest.raises(VllmLayoutError, match=match) as err:
        VllmKVLayout.from_kv_caches(caches, kw.pop("block_size", PS), **kw)
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


def test_what_cannot_be_laid_out_the_same_is_refused_in_one_typed_line():
    rows = _caches("rows", 1)
    name = next(iter(rows))
    _refused({}, "non-empty dict")
    _refused(rows, "block_size", block_size=0)
    # HND: head-major with K|V channels (VLLM_KV_CACHE_LAYOUT=HND on a GPU backend)
    _refused(rows, "HND", kv_split="channels")
    _refused(rows, "HND", backend="FLASH_ATTN")
    _refused(_caches("channels", 1), "head-major layout", kv_split="rows")
    _refused(rows, "backend 'XFORMERS' is not supported", backend="XFORMERS")
    # quantized / packed KV
    _refused(make_kv_caches("channels", 2, 4, HEADS, PS, DIM, torch.uint8), "quantized or packed")
    _refused(make_kv_caches("channels", 2, 4, HEADS, PS, DIM, torch.float8_e4m3fn), "quantized or packed")
    # MLA latent caches, odd widths
    _refused({"model.layers.0.attn": torch.zeros(4, PS, 10)}, "MLA")
    _refused({"model.layers.0.attn": torch.zeros(4, HEADS, PS, 9)}, "2\\*head_dim")
    # hybrid groups: layers of different shapes
    mixed = dict(rows)
    mixed["model.layers.9.attn"] = torch.zeros(12, HEADS, PS, 4 * DIM, dtype=torch.bfloat16)
    _refused(mixed, "hybrid or mixed")
    # names: no index, two indices, the same index twice
    _refused({"attn": rows[name]}, "exactly one layer index")
    _refused({"model.layers.0.experts.1.attn": rows[name]}, "exactly one layer index")
    _refused({"a.0.attn": rows[name], "b.0.attn": rows[name]}, "share layer index 0")
    # cross-layer KV sharing: two layers on the same memory
    _refused({"model.layers.0.attn": rows[name], "model.layers.1.attn": rows[name]}, "share KV memory")
    # kernel blocks that do not tile the block
    _refused(make_kv_caches("rows", 2, 5, HEADS, 3, DIM, torch.bfloat16), "do not tile")
    # a row split whose head interior is not dense
    loose = torch.zeros(4, HEADS, PS, 4 * DIM, dtype=torch.bfloat16)[..., : 2 * DIM]
    _refused({"model.layers.0.attn": loose}, "not dense", kv_split="rows")


def test_block_and_host_indices_are_checked():
    layout = VllmKVLayout.from_kv_caches(_caches("rows", 1), PS)
    with pytest.raises(IndexError):
        layout.page_bytes_of([12])
    with pytest.raises(IndexError):
        layout.page_bytes_of([-1])
    host = layout.host_pool(2 * PS, pin=False)
    with pytest.raises(ValueError, match="2 blocks, 1 host pages"):
        layout.to_host([0, 1], host, [0])
    with pytest.raises(IndexError):
        layout.to_host([0], host, [2])
    with pytest.raises(ValueError, match="pages"):
        layout.write_pages([0], torch.zeros(1, 2, PS, LAYERS, HEADS, DIM))   # fp32, not bf16
    assert torch.equal(layout.slots_of([3, 1]), torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]))

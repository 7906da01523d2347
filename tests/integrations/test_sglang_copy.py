"""Copies between SGLang's per-layer device buffers (read in place) and the page-first host pool,
for consecutive and scattered device pages, both ways, bit-exact."""

from __future__ import annotations

import pytest
import torch

from lifecycle.integrations.sglang.device_pool import LayeredKVPool
from lifecycle.integrations.sglang.layered_copy import LayeredChunkCopy, LayeredCpuCopyEngine
from transfer.host_pool import HostPool

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8


def _pool(mla: bool, dtype=torch.bfloat16) -> LayeredKVPool:
    heads = 1 if mla else HEADS
    gen = torch.Generator().manual_seed(1)
    return LayeredKVPool([[torch.randn(64, heads, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
                          for _ in range(1 if mla else 2)], mla=mla)


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dev_pages,host_pages,gather", [
    ([2, 3, 4], [0, 1, 2], False),   # consecutive on both sides: one strided copy per buffer
    ([9, 2, 14], [3, 4, 5], True),   # scattered device pages: row gathers
    ([5, 6, 1], [7, 0, 1], True),    # two host runs
])
def test_round_trip_is_bit_exact(mla, dev_pages, host_pages, gather):
    kv = _pool(mla)
    host = HostPool(LAYERS, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    slots, hp = _slots(dev_pages), torch.tensor(host_pages)
    plan = LayeredChunkCopy(kv, host, slots, hp)
    assert plan.gather is gather
    plan.to_host()
    want = kv.read(slots)  # [kinds, layers, n, heads, dim]
    for i, page in enumerate(host_pages):
        got = host.page_view(page)  # [kinds, ps, layers, heads, dim]
        assert torch.equal(got.view(torch.int16), want[:, :, i * PS:(i + 1) * PS].transpose(1, 2).view(torch.int16))
    back = _pool(mla)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    LayeredChunkCopy(back, host, slots, hp).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))


def test_the_engine_reports_the_copy_once():
    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    engine = LayeredCpuCopyEngine(1)
    engine.to_host("t", kv, host, _slots([3, 1]), torch.tensor([0, 1]))
    engine.close()
    assert [d.tag for d in engine.poll()] == ["t"]


def test_pools_of_another_shape_are_refused():
    kv = _pool(False)
    with pytest.raises(ValueError, match="disagree"):
        LayeredChunkCopy(kv, HostPool(LAYERS, HEADS, DIM, torch.float16, PS, 4 * PS, pin=False),
                         _slots([1]), torch.tensor([0]))


def test_the_cpu_engine_refuses_device_buffers_and_none_is_made_for_them():
    """'meta' stands in for CUDA: buffers that are not in host memory (issue 25, point 6)."""
    from lifecycle.integrations.sglang.layered_copy import make_layered_copy_engine

    kv = LayeredKVPool([[torch.empty(64, HEADS, DIM, dtype=torch.bfloat16, device="meta") for _ in range(LAYERS)]
                        for _ in range(2)], mla=False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    engine = LayeredCpuCopyEngine(1)
    with pytest.raises(ValueError, match="meta"):  # DeviceMismatch
        engine.to_host("t", kv, host, _slots([1]), torch.tensor([0]))
    assert engine.pending == 0
    engine.close()
    with pytest.raises(ValueError, match="meta"):
        make_layered_copy_engine(kv)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dev_pages,host_pages", [([9, 2, 14], [3, 4, 5]), ([5, 6, 1], [7, 0, 1])])
def test_the_staged_path_round_trip_is_bit_exact_through_one_reused_buffer(mla, dev_pages, host_pages):
    """What the CUDA engine runs (one gather per buffer of whole pages straight into its slab of
    the engine's staging buffer, one copy per host run; ids checked on the device), on CPU."""
    from transfer.gather import Staging

    kv = _pool(mla)
    host = HostPool(LAYERS, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    slots, hp = _slots(dev_pages), torch.tensor(host_pages)
    staging = Staging("cpu")
    plan = LayeredChunkCopy(kv, host, slots, hp, check_end=64, staging=staging)
    plan.to_host()
    assert plan.landed_error() is None
    want = kv.read(slots)
    for i, page in enumerate(host_pages):
        got = host.page_view(page)
        assert torch.equal(got.view(torch.int16), want[:, :, i * PS:(i + 1) * PS].transpose(1, 2).view(torch.int16))
    back = _pool(mla)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    LayeredChunkCopy(back, host, slots, hp, check_end=64, staging=staging).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))
    assert staging.grown == 1


def test_the_staged_path_reports_bad_ids_after_the_copy():
    from transfer.errors import BadIndices
    from transfer.gather import Staging

    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    plan = LayeredChunkCopy(kv, host, torch.tensor([5, 6, 7, 8]), torch.tensor([0]), check_end=64,
                            staging=Staging("cpu"))
    plan.to_host()
    assert isinstance(plan.landed_error(), BadIndices)


def test_the_engine_copies_back_to_the_device_bit_exact_and_checks_the_ids_on_its_worker():
    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    slots, hp = _slots([3, 1]), torch.tensor([2, 0])
    engine = LayeredCpuCopyEngine(1)
    engine.to_host("out", kv, host, slots, hp, check_end=64)
    engine.close()
    assert [(d.tag, d.error) for d in engine.poll()] == [("out", None)]
    want = kv.read(slots)
    back = _pool(False)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    engine = LayeredCpuCopyEngine(1)
    engine.to_device("in", back, host, slots, hp, check_end=64)
    engine.to_device("bad", back, host, _slots([16]), torch.tensor([1]), check_end=64)  # slot 64: past the end
    engine.close()
    done = {d.tag: d.error for d in engine.poll()}
    assert done["in"] is None and isinstance(done["bad"], ValueError)
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))
    assert not back.read(_slots([2])).any()  # nothing else written


def test_the_cpu_engine_refuses_a_device_pool_for_copies_back_too():
    kv = LayeredKVPool([[torch.empty(64, HEADS, DIM, dtype=torch.bfloat16, device="meta") for _ in range(LAYERS)]
                        for _ in range(2)], mla=False)
    engine = LayeredCpuCopyEngine(1)
    with pytest.raises(ValueError, match="copies host-memory pools only; this pool is on meta"):
        engine.to_device("t", kv, HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False),
                         _slots([1]), torch.tensor([0]))
    assert engine.pending == 0
    engine.close()


# --- issue 34: the all-layer kernel path, the batched staged path, the staging budget ---------------


class ReferenceKvcacheio:
    """SGLang's ``sgl_kernel.kvcacheio`` transfer functions on the CPU, written from its source
    (``sgl-kernel/csrc/kvcacheio/transfer.cu``): a token is ``item_size`` bytes; a layer-first
    buffer's token ``i`` of layer ``l`` is at ``table[l] + i * item_size`` (all-layer: a table of
    the per-layer buffers' addresses) or ``buffer + i * item_size`` (per-layer); a page-first
    buffer's at ``base + i * layout_dim + l * item_size``; negative ids are skipped. Addresses are
    resolved against the tensors it is told about (never dereferenced), and it records each call."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.calls: list[tuple[str, dict]] = []
        self._by_address = {}
        for t in tensors:
            storage = t.untyped_storage()
            self._by_address[t.data_ptr()] = storage

    def _bytes(self, address: int) -> tuple[torch.Tensor, int]:
        """The storage holding ``address`` as flat bytes, and the offset of ``address`` in it."""
        for start, storage in self._by_address.items():
            base = storage.data_ptr()
            if base <= address < base + storage.nbytes():
                return torch.empty(0, dtype=torch.uint8).set_(storage), address - base
        raise AssertionError(f"address {address:#x} is in no known tensor")

    @staticmethod
    def _checks(src_indices, dst_indices, item_size):
        assert src_indices.dtype is torch.int64 and dst_indices.dtype is torch.int64
        assert src_indices.numel() == dst_indices.numel() and item_size % 8 == 0

    def _move(self, src_addr, dst_addr, src_ids, dst_ids, item_size):
        """Token ``src_ids[i]`` at ``src_addr(id)`` -> ``dst_addr(id)``, ``item_size`` bytes each."""
        for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
            if s < 0 or d < 0:
                continue
            src, so = self._bytes(src_addr(s))
            dst, do = self._bytes(dst_addr(d))
            assert so + item_size <= src.numel() and do + item_size <= dst.numel(), "out of bounds"
            dst[do:do + item_size] = src[so:so + item_size]

    def transfer_kv_all_layer_lf_pf(self, *, src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                    dst_indices, item_size, dst_layout_dim, num_layers):
        self.calls.append(("all_layer_lf_pf", dict(item_size=item_size, dst_layout_dim=dst_layout_dim,
                                                   num_layers=num_layers)))
        self._checks(src_indices, dst_indices, item_size)
        for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
            assert table.dtype is torch.uint64 and table.numel() == num_layers
            for layer, base in enumerate(table.tolist()):
                self._move(lambda i, b=base: b + i * item_size,
                           lambda i, l=layer, d=dst.data_ptr(): d + i * dst_layout_dim + l * item_size,
                           src_indices, dst_indices, item_size)

    def transfer_kv_all_layer_mla_lf_pf(self, *, src_layers, dst, src_indices, dst_indices, item_size,
                                        dst_layout_dim, num_layers):
        self.calls.append(("all_layer_mla_lf_pf", dict(item_size=item_size, dst_layout_dim=dst_layout_dim,
                                                       num_layers=num_layers)))
        self._checks(src_indices, dst_indices, item_size)
        assert src_layers.dtype is torch.uint64 and src_layers.numel() == num_layers
        for layer, base in enumerate(src_layers.tolist()):
            self._move(lambda i, b=base: b + i * item_size,
                       lambda i, l=layer, d=dst.data_ptr(): d + i * dst_layout_dim + l * item_size,
                       src_indices, dst_indices, item_size)

    def transfer_kv_per_layer_pf_lf(self, *, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id,
                                    item_size, src_layout_dim):
        self.calls.append(("per_layer_pf_lf", dict(layer_id=layer_id, item_size=item_size)))
        self._checks(src_indices, dst_indices, item_size)
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            self._move(lambda i, s=src.data_ptr(): s + i * src_layout_dim + layer_id * item_size,
                       lambda i, d=dst.data_ptr(): d + i * item_size, src_indices, dst_indices, item_size)

    def transfer_kv_per_layer_mla_pf_lf(self, *, src, dst, src_indices, dst_indices, layer_id, item_size,
                                        src_layout_dim):
        self.calls.append(("per_layer_mla_pf_lf", dict(layer_id=layer_id, item_size=item_size)))
        self._checks(src_indices, dst_indices, item_size)
        self._move(lambda i, s=src.data_ptr(): s + i * src_layout_dim + layer_id * item_size,
                   lambda i, d=dst.data_ptr(): d + i * item_size, src_indices, dst_indices, item_size)


def _deep_pool(mla: bool, layers: int, slots: int = 64, dim: int = DIM, seed: int = 1) -> LayeredKVPool:
    heads = 1 if mla else HEADS
    gen = torch.Generator().manual_seed(seed)
    return LayeredKVPool([[torch.randn(slots, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(layers)]
                          for _ in range(1 if mla else 2)], mla=mla)


def _host_pages_want(kv: LayeredKVPool, slots: torch.Tensor) -> torch.Tensor:
    """The simple reference: host pages of ``slots`` read token by token, ``[pages, kinds, ps,
    layers, heads, dim]`` as int16."""
    pages = []
    for p in range(slots.numel() // PS):
        page = torch.empty(kv.kinds, PS, kv.layers, kv.heads, kv.head_dim, dtype=kv.dtype)
        for k in range(kv.kinds):
            for t in range(PS):
                for layer in range(kv.layers):
                    page[k, t, layer] = kv.buffers[k][layer][int(slots[p * PS + t])]
        pages.append(page)
    return torch.stack(pages).view(torch.int16)


# device pages, host pages: one run on both sides; scattered device pages; two host runs; all scattered
_LAYOUTS = [([2, 3, 4], [0, 1, 2]), ([9, 2, 14], [3, 4, 5]), ([5, 6, 1], [7, 0, 1]), ([12, 3, 7], [6, 2, 4])]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layers", [1, 3, 7])
@pytest.mark.parametrize("path", ["direct", "staged", "kernel"])
@pytest.mark.parametrize("dev_pages,host_pages", _LAYOUTS, ids=["runs", "scattered", "two-host-runs", "all-scattered"])
def test_every_path_copies_byte_identically_to_a_simple_reference(mla, layers, path, dev_pages, host_pages):
    """The batched copies (views built once per pool, one op per buffer or one kernel per chunk)
    move exactly the bytes a token-by-token reference moves, both ways, nothing else."""
    from transfer.gather import Staging

    kv = _deep_pool(mla, layers)
    host = HostPool(layers, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    slots, hp = _slots(dev_pages), torch.tensor(host_pages)
    kernel = ReferenceKvcacheio(*[b for kind in kv.buffers for b in kind], host.buffer)
    extra = {"direct": {}, "staged": {"staging": Staging("cpu")}, "kernel": {"kernel": kernel}}[path]
    plan = LayeredChunkCopy(kv, host, slots, hp, check_end=64, **extra)
    plan.to_host()
    assert plan.landed_error() is None
    want = _host_pages_want(kv, slots)
    assert torch.equal(host.buffer[hp].view(torch.int16), want)
    untouched = [p for p in range(8) if p not in host_pages]
    assert not host.buffer[untouched].view(torch.int16).any()
    back = _deep_pool(mla, layers, seed=2)
    before = [[b.clone() for b in kind] for kind in back.buffers]
    kernel = ReferenceKvcacheio(*[b for kind in back.buffers for b in kind], host.buffer)
    extra = {"direct": {}, "staged": {"staging": Staging("cpu")}, "kernel": {"kernel": kernel}}[path]
    LayeredChunkCopy(back, host, slots, hp, check_end=64, **extra).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), kv.read(slots).view(torch.int16))
    others = torch.tensor([s for s in range(64) if s not in set(slots.tolist())])
    for k, kind in enumerate(back.buffers):
        for layer, buf in enumerate(kind):
            assert torch.equal(buf[others].view(torch.int16), before[k][layer][others].view(torch.int16))
    if path == "kernel":  # one launch per chunk out, one per layer back (as SGLang loads)
        assert [c[0] for c in kernel.calls] == ["per_layer_mla_pf_lf" if mla else "per_layer_pf_lf"] * layers


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_the_kernel_is_called_once_per_chunk_with_sglangs_page_first_arguments(mla):
    """The arguments SGLang 0.5.19's HiCache host pool passes for its page_first layout: the
    per-kind tables of the per-layer buffers' addresses, the host buffer's K (V) base, item size a
    token row, destination stride a token's row over all layers, and host ids addressing
    ``buffer[page, kind, token, layer]``."""
    from lifecycle.integrations.sglang.layered_copy import address_tables

    layers = 5
    kv = _deep_pool(mla, layers)
    host = HostPool(layers, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    kernel = ReferenceKvcacheio(*[b for kind in kv.buffers for b in kind], host.buffer)
    plan = LayeredChunkCopy(kv, host, _slots([9, 2]), torch.tensor([6, 3]), check_end=64, kernel=kernel)
    plan.to_host()
    name = "all_layer_mla_lf_pf" if mla else "all_layer_lf_pf"
    assert kernel.calls == [(name, dict(item_size=kv.row_bytes, dst_layout_dim=layers * kv.row_bytes,
                                        num_layers=layers))]
    tables = address_tables(kv)
    assert [t.tolist() for t in tables] == [[b.data_ptr() for b in kind] for kind in kv.buffers]
    assert all(t.dtype is torch.uint64 and t.device == kv.device for t in tables)
    assert address_tables(kv) is tables  # built once per pool
    kinds = kv.kinds
    assert plan.host_ids.tolist() == [p * kinds * PS + t for p in (6, 3) for t in range(PS)]


def test_the_kernel_path_checks_and_clamps_ids_even_when_not_asked():
    """The kernel reads where the ids say, unchecked: ids past the pool are clamped on the device
    (never read out of bounds) and the copy reports ``BadIndices`` after its event."""
    from transfer.errors import BadIndices

    kv = _deep_pool(False, 3)
    host = HostPool(3, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    kernel = ReferenceKvcacheio(*[b for kind in kv.buffers for b in kind], host.buffer)
    plan = LayeredChunkCopy(kv, host, torch.arange(64, 68), torch.tensor([1]), kernel=kernel)
    plan.to_host()  # the reference asserts on any out-of-bounds address
    assert isinstance(plan.landed_error(), BadIndices)


def test_rows_the_kernel_cannot_move_take_the_staged_path():
    """A token row that is not a multiple of 8 bytes (the kernel moves 8-byte words)."""
    from transfer.gather import Staging

    kv = _deep_pool(False, 2, dim=2)  # 2 heads x 2 x bf16 = 8 bytes: fits
    host = HostPool(2, HEADS, 2, kv.dtype, PS, 4 * PS, pin=False)
    assert LayeredChunkCopy(kv, host, _slots([1]), torch.tensor([0]), kernel=object()).kernel is not None
    odd = LayeredKVPool([[torch.zeros(64, 1, 2, dtype=torch.bfloat16) for _ in range(2)]], mla=True)  # 4 bytes
    host = HostPool(2, 1, 2, odd.dtype, PS, 4 * PS, mla=True, pin=False)
    plan = LayeredChunkCopy(odd, host, _slots([1]), torch.tensor([0]), staging=Staging("cpu"), kernel=object())
    assert plan.kernel is None
    plan.to_host()


def test_sgl_kernel_is_used_only_when_it_has_every_function(monkeypatch):
    import sys
    import types

    from lifecycle.integrations.sglang.layered_copy import KERNEL_FUNCTIONS, load_kernel

    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # not installed (as on this machine)
    assert load_kernel() is None
    partial = types.ModuleType("sgl_kernel.kvcacheio")
    for name in KERNEL_FUNCTIONS[:-1]:
        setattr(partial, name, lambda **kw: None)
    package = types.ModuleType("sgl_kernel")
    package.kvcacheio = partial
    monkeypatch.setitem(sys.modules, "sgl_kernel", package)
    monkeypatch.setitem(sys.modules, "sgl_kernel.kvcacheio", partial)
    assert load_kernel() is None  # an sgl_kernel without the all-layer page-first kernels
    setattr(partial, KERNEL_FUNCTIONS[-1], lambda **kw: None)
    assert load_kernel() is partial


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("budget_pages", [1, 2, 0.5], ids=["one-page", "two-pages", "half-a-page"])
def test_a_chunk_larger_than_the_staging_budget_is_copied_in_pieces_within_it(mla, budget_pages):
    """Never a buffer over the budget (one page when a page is larger): 5 pages through a budget
    of 1 or 2 pages (or half a page: one page at a time), both ways, byte-identical."""
    from transfer.gather import Staging

    kv = _deep_pool(mla, 3)
    host = HostPool(3, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    budget = int(budget_pages * host.page_nbytes)
    staging = Staging("cpu", budget)
    slots, hp = _slots([9, 2, 14, 3, 4]), torch.tensor([7, 0, 1, 2, 5])
    LayeredChunkCopy(kv, host, slots, hp, check_end=64, staging=staging).to_host()
    assert torch.equal(host.buffer[hp].view(torch.int16), _host_pages_want(kv, slots))
    back = _deep_pool(mla, 3, seed=2)
    LayeredChunkCopy(back, host, slots, hp, check_end=64, staging=staging).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), kv.read(slots).view(torch.int16))
    assert staging.peak_bytes == max(budget, host.page_nbytes) // host.page_nbytes * host.page_nbytes
    assert staging.grown == 1


def test_a_bad_staging_budget_is_refused_before_an_engine_is_made():
    from lifecycle.integrations.sglang.layered_copy import make_layered_copy_engine

    for bad in (0, -1, 1.5, True, "16"):
        with pytest.raises(ValueError, match="staging budget"):
            make_layered_copy_engine(_pool(False), staging_bytes=bad)


@pytest.fixture
def stdlib_logging():
    """Events to the stdlib ``logging`` loggers (caplog), as in an application that never
    configured structlog (the suite configures it: tests/conftest.py)."""
    import structlog

    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.configure(**saved)


def test_a_large_copy_work_per_step_is_warned_at_construction(caplog, stdlib_logging):
    """``copy ops per chunk / stride`` above ``OPS_PER_REQUEST_STEP_WARN`` (4): the per-buffer path
    at 80-layer MHA (160 gathers a chunk) and a 16-token stride warns (10); a 64-token stride
    (2.5), or the kernel path (one launch a chunk), does not."""
    import logging

    from lifecycle.integrations.sglang.layered_copy import (OPS_PER_REQUEST_STEP_WARN, make_layered_copy_engine,
                                                             warn_if_copy_work_large)

    kv = LayeredKVPool([[torch.zeros(64, 1, 8, dtype=torch.bfloat16) for _ in range(80)] for _ in range(2)], mla=False)
    name = "lifecycle.integrations.sglang.layered_copy"
    with caplog.at_level(logging.WARNING, logger=name):
        make_layered_copy_engine(kv, offload_stride=16).close()
    [record] = [r for r in caplog.records if r.name == name]
    assert record.levelno == logging.WARNING
    assert record.event_dict["event"] == "sglang.copy_work_large"
    assert record.event_dict["ops_per_request_step"] == 160 / 16 > OPS_PER_REQUEST_STEP_WARN
    assert record.event_dict["path"] == "per-buffer" and record.event_dict["stride"] == 16
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=name):
        make_layered_copy_engine(kv, offload_stride=64).close()            # 160 / 64 = 2.5
        assert warn_if_copy_work_large(kv, 16, kernel=True) == 1 / 16       # one launch per chunk
        assert warn_if_copy_work_large(kv, 40, kernel=False) == 4           # at the limit: quiet
        make_layered_copy_engine(kv).close()                               # no stride: no estimate
    assert [r for r in caplog.records if r.name == name] == []


def test_an_unpinned_host_pool_never_takes_the_kernel_path_on_cuda():
    """The kernel writes host memory through its device mapping: pageable memory has none. (A pool
    on CUDA cannot be made here; the rule reads only the pool's device and row width.)"""
    import types

    from lifecycle.integrations.sglang.layered_copy import kernel_fits

    host = HostPool(LAYERS, HEADS, DIM, torch.bfloat16, PS, 4 * PS, pin=False)
    assert not host.pinned
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"), row_bytes=HEADS * DIM * 2)
    assert not kernel_fits(on_cuda, host)
    assert kernel_fits(_pool(False), host)  # host memory on both sides (the CPU reference runs)

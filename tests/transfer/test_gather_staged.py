"""The staged copy path (what runs on CUDA: a device row index, one gather into the copy stream's
reused ``Staging`` buffer, one copy per run of host pages; slot ids checked on the device, verdict
read after the copy) run on CPU tensors: bit-exact, no allocation per chunk, bad ids clamped and
reported instead of raising (issue 25, points 1 and 3); and the device-side check of a release
plan's slot ids (``check_ids_on_device``), run on the CPU stand-in for device memory."""

from __future__ import annotations

import pytest
import torch

from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync
from transfer import BadIndices, HostPool, KVPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from transfer.gather import ID_VERDICT, ChunkCopy, Staging, check_ids_on_device, ids_verdict

PS = 4


def pools(mla=False, dtype=torch.bfloat16):
    heads = 1 if mla else 2
    kv = KVPool(3, heads, 8, dtype, 66, mla=mla)  # 66 slots: a partial last page
    kv.write(torch.arange(66), synthetic_kv(kv, 5, torch.arange(66)))
    return kv, HostPool(3, heads, 8, dtype, PS, 40, mla=mla, pin=False)


def page_bytes(kv, slots):
    return kv.read(slots).permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
def test_staged_round_trip_is_bit_exact_and_reuses_one_buffer(mla, dtype):
    kv, host = pools(mla, dtype)
    staging = Staging("cpu")
    dev_pages, host_pages = [9, 2, 14], torch.tensor([7, 3, 4])  # scattered, two host runs
    slots = (torch.tensor(dev_pages).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)
    ChunkCopy(kv, host, slots, host_pages, check_end=kv.slots, staging=staging).to_host()
    for i, p in enumerate(host_pages.tolist()):
        assert torch.equal(host.page_view(p).contiguous().view(torch.uint8), page_bytes(kv, slots[i * PS:(i + 1) * PS]))
    dst = (torch.tensor([1, 11, 5]).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)
    plan = ChunkCopy(kv, host, dst, host_pages, check_end=kv.slots, staging=staging)
    plan.to_device()
    assert plan.landed_error() is None
    assert torch.equal(kv.read(dst).view(torch.uint8), kv.read(slots).view(torch.uint8))
    assert staging.grown == 1  # both chunks through the one buffer
    ChunkCopy(kv, host, torch.arange(4, 20), torch.tensor([0, 1, 2, 3]), staging=staging).to_host()
    assert staging.grown == 2  # a larger chunk grows it once


@pytest.mark.parametrize("ids", [[8, 9, 10, 12], [6, 7, 8, 9], [64, 65, 66, 67], [-4, -3, -2, -1]],
                         ids=["not-consecutive", "not-aligned", "outside", "negative"])
def test_bad_ids_are_clamped_and_reported_after_the_copy_never_raised(ids):
    kv, host = pools()
    before = kv.buffer.clone()
    plan = ChunkCopy(kv, host, torch.tensor(ids), torch.tensor([0]), check_end=kv.slots, staging=Staging("cpu"))
    plan.to_host()  # no out-of-bounds read, no exception at launch
    assert isinstance(plan.landed_error(), BadIndices)
    plan.to_device()  # clamped: writes only inside the pool
    assert kv.buffer.shape == before.shape


def test_good_ids_report_no_error():
    kv, host = pools()
    plan = ChunkCopy(kv, host, torch.arange(8, 16), torch.tensor([0, 1]), check_end=kv.slots, staging=Staging("cpu"))
    plan.to_host()
    assert plan.landed_error() is None


# --- check_ids_on_device: a device row's slot ids checked where they live (release plans) ---------


@pytest.mark.parametrize("ids, end, want", [
    ([7, 4, 5, 6], 66, None),                                  # good, unsorted
    ([3], 66, None),                                           # one id
    ([4, -1, 5, -1], 66, dict(negative=2, out_of_range=0, repeated=0, min=-1, max=5, repeated_id=-1)),
    ([9, 4, 9, 5, 9], 66, dict(negative=0, out_of_range=0, repeated=2, min=4, max=9, repeated_id=9)),
    ([4, 66, 5, 1000], 66, dict(negative=0, out_of_range=2, repeated=0, min=4, max=1000, repeated_id=-1)),
    ([4, 1000], None, None),                                   # no pool size known: range not checked
    ([-3, 70, 8, 8], 66, dict(negative=1, out_of_range=1, repeated=1, min=-3, max=70, repeated_id=8)),
], ids=["good", "one", "negative", "repeated", "out-of-range", "no-end", "all-three"])
def test_device_ids_are_checked_without_a_host_read(ids, end, want):
    t = as_device_resident(torch.tensor(ids, dtype=torch.int64))
    with no_host_sync():  # any host read of the ids raises HostSync
        verdict, event = check_ids_on_device(t, end)
    assert event is None  # off CUDA the verdict is there at once
    assert type(verdict) is torch.Tensor and verdict.shape == (len(ID_VERDICT),)  # host memory
    assert ids_verdict(verdict) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU stand-in runs above)")
def test_on_cuda_the_verdict_is_pinned_and_read_after_its_event():
    ids = torch.tensor([8, -1, 8, 500], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdict, event = check_ids_on_device(ids, 66)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert verdict.is_pinned() and verdict.device.type == "cpu" and event is not None
    event.synchronize()
    assert ids_verdict(verdict) == dict(negative=1, out_of_range=1, repeated=1, min=-1, max=500, repeated_id=8)


# --- edges: the first and last whole page of the pool, slot id 0, verdict types ----------------


@pytest.mark.parametrize("dev_page", [0, 15], ids=["first-page", "last-page"])
def test_the_first_and_last_page_inside_check_end_are_good_and_copied_exactly(dev_page):
    kv, host = pools()
    end = 64                                          # whole pages 0..15
    slots = torch.arange(dev_page * PS, (dev_page + 1) * PS)
    plan = ChunkCopy(kv, host, slots, torch.tensor([6]), check_end=end, staging=Staging("cpu"))
    plan.to_host()
    assert plan.landed_error() is None
    assert torch.equal(host.page_view(6).contiguous().view(torch.uint8), page_bytes(kv, slots))
    back = ChunkCopy(kv, host, torch.arange(20, 24), torch.tensor([6]), check_end=end, staging=Staging("cpu"))
    back.to_device()
    assert back.landed_error() is None
    assert torch.equal(kv.read(torch.arange(20, 24)).view(torch.uint8), kv.read(slots).view(torch.uint8))


def test_a_bad_chunk_reports_the_pool_range_in_its_error():
    kv, host = pools()
    plan = ChunkCopy(kv, host, torch.arange(64, 68), torch.tensor([0]), check_end=64, staging=Staging("cpu"))
    plan.to_host()
    err = plan.landed_error()
    assert isinstance(err, BadIndices)
    assert str(err) == ("device indices are not whole, page-aligned pages inside 0..63: "
                        "the copy moved nothing worth keeping")


def test_row_word_is_the_widest_integer_dividing_the_row():
    from transfer.gather import row_word

    assert [row_word(n) for n in (16, 12, 6, 3)] == [torch.int64, torch.int32, torch.int16, torch.uint8]
    buf = torch.zeros(64, dtype=torch.uint8)
    assert row_word(16, buf[2:]) is torch.int16        # a buffer starting 2 bytes past alignment


def test_odd_row_widths_round_trip_bit_exact():
    # rows of 12 bytes (int32 words) and 6 bytes (int16 words)
    for heads, dim in ((1, 6), (3, 1)):
        kv = KVPool(2, heads, dim, torch.bfloat16, 32)
        kv.write(torch.arange(32), synthetic_kv(kv, 3, torch.arange(32)))
        host = HostPool(2, heads, dim, torch.bfloat16, PS, 16, pin=False)
        slots = torch.arange(8, 16)
        ChunkCopy(kv, host, slots, torch.tensor([1, 2])).to_host()
        for i, p in enumerate((1, 2)):
            assert torch.equal(host.page_view(p).contiguous().view(torch.uint8), page_bytes(kv, slots[i * PS:(i + 1) * PS]))


def test_page_runs_are_plain_ints():
    from transfer.gather import page_runs

    for pages in (torch.tensor([3, 4, 9, 10, 11, 2]), [3, 4, 9, 10, 11, 2]):
        runs = page_runs(pages)
        assert runs == [(0, 3, 2), (2, 9, 3), (5, 2, 1)]
        assert all(type(x) is int for run in runs for x in run)


def test_staging_lives_on_its_device():
    s = Staging("meta")
    assert s.device == torch.device("meta")
    buf = s.take(3, 5, torch.int32)
    assert buf.device.type == "meta" and buf.shape == (3, 5) and buf.dtype == torch.int32


@pytest.mark.parametrize("ids, want", [
    ([0, 4, 8], None),                                           # slot 0 is a good id
    ([0, 0], dict(negative=0, out_of_range=0, repeated=1, min=0, max=0, repeated_id=0)),
    ([-5], dict(negative=1, out_of_range=0, repeated=0, min=-5, max=-5, repeated_id=-1)),
], ids=["zero", "zero-repeated", "one-negative"])
def test_device_id_edges(ids, want):
    verdict, event = check_ids_on_device(torch.tensor(ids, dtype=torch.int64), 66)
    assert verdict.dtype == torch.int64
    got = ids_verdict(verdict)
    assert got == want
    if got is not None:
        assert all(type(v) is int for v in got.values())


# --- the staging budget (issue 34): a chunk over it is copied in pieces, the buffer never over it ---


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("budget_pages", [1, 2, 3, 0.25], ids=["one-page", "two-pages", "three-pages", "quarter-page"])
def test_a_chunk_over_the_staging_budget_is_copied_in_pieces_and_the_buffer_stays_within_it(mla, budget_pages):
    kv, host = pools(mla)
    budget = int(budget_pages * host.page_nbytes)
    staging = Staging("cpu", budget)
    dev_pages, host_pages = [9, 2, 14, 3, 4, 10, 0], torch.tensor([7, 3, 4, 5, 0, 1, 9])  # scattered, runs split
    slots = (torch.tensor(dev_pages).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)
    plan = ChunkCopy(kv, host, slots, host_pages, check_end=kv.slots, staging=staging)
    plan.to_host()
    assert plan.landed_error() is None
    for i, p in enumerate(host_pages.tolist()):
        assert torch.equal(host.page_view(p).contiguous().view(torch.uint8), page_bytes(kv, slots[i * PS:(i + 1) * PS]))
    dst = (torch.tensor([1, 11, 5, 6, 7, 12, 13]).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)
    ChunkCopy(kv, host, dst, host_pages, check_end=kv.slots, staging=staging).to_device()
    assert torch.equal(kv.read(dst).view(torch.uint8), kv.read(slots).view(torch.uint8))
    whole_pages = max(1, budget // host.page_nbytes)
    assert staging.peak_bytes == min(whole_pages, 7) * host.page_nbytes <= max(budget, host.page_nbytes)
    assert staging.grown == 1


def test_the_default_budget_holds_a_small_chunk_in_one_piece():
    from transfer.gather import DEFAULT_STAGING_BYTES

    staging = Staging("cpu")
    assert staging.budget_bytes == DEFAULT_STAGING_BYTES == 16 << 20
    assert staging.pieces(7, 4096) == [(0, 7)]
    assert staging.pieces(5000, 4096) == [(0, 4096), (4096, 904)]
    assert Staging("cpu", 100).pieces(3, 4096) == [(0, 1), (1, 1), (2, 1)]  # at least one page


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "16", None])
def test_a_bad_staging_budget_is_refused(bad):
    with pytest.raises(ValueError, match="staging budget must be a positive number of bytes"):
        Staging("cpu", bad)


def test_staging_refuses_more_than_its_budget_and_never_allocates_it():
    s = Staging("cpu", 64)
    with pytest.raises(ValueError, match="over the 64-byte budget"):
        s.take(5, 4, torch.int32)                      # 80 bytes
    assert s.grown == 0 and s.peak_bytes == 0
    assert s.take(5, 4, torch.int32, page_bytes=80).shape == (5, 4)  # one page larger than the budget
    assert s.peak_bytes == 80


def test_the_cuda_engine_refuses_a_bad_budget_before_anything_else():
    from transfer.copy_engine import CudaCopyEngine

    with pytest.raises(ValueError, match="staging budget"):
        CudaCopyEngine("cuda", staging_bytes=0)       # refused before CUDA is looked at (none here)


def test_piece_runs_cut_host_runs_at_piece_bounds():
    from transfer.gather import page_runs, piece_runs

    runs = page_runs([7, 3, 4, 5, 0, 1, 9])          # (0,7,1) (1,3,3) (4,0,2) (6,9,1)
    assert piece_runs(runs, 0, 2) == [(0, 7, 1), (1, 3, 1)]
    assert piece_runs(runs, 2, 2) == [(0, 4, 2)]
    assert piece_runs(runs, 4, 3) == [(0, 0, 2), (2, 9, 1)]
    assert piece_runs(runs, 0, 7) == runs


# --- check_chunk_on_device: a device chunk's pages distinct, not read, held (issue 34, point 3) ------

def _pages(*pages):
    return as_device_resident((torch.tensor(pages).view(-1, 1) * PS + torch.arange(PS)).reshape(-1))


@pytest.mark.parametrize("ids, bad", [
    (_pages(2, 3, 5), False),
    (_pages(2, 3, 2), True),                    # a page listed twice
    (_pages(2, 7), True),                       # page 7 is read by a copy in flight
    (_pages(2, 9), True),                       # page 9: the allocator does not hold it
    (_pages(0, 2), True),                       # page 0: the padding page, never held
], ids=["good", "repeated", "read-by-another-copy", "not-held", "padding-page"])
def test_check_chunk_on_device_refuses_what_the_host_check_refuses_without_a_read(ids, bad):
    from transfer.gather import check_chunk_on_device

    end = 16 * PS
    reads = torch.zeros(16, dtype=torch.int32)
    reads[7] = 1
    held = torch.ones(17, dtype=torch.bool)
    held[0] = held[9] = False
    with no_host_sync():
        verdict, pages = check_chunk_on_device(ids, PS, end, reads, held, PS)
    assert bool(verdict) is bad and pages.shape == (ids.shape[0] // PS,)


def test_check_chunk_on_device_asks_every_allocator_page_of_a_page():
    from transfer.gather import check_chunk_on_device

    held = torch.ones(64 + 1, dtype=torch.bool)  # allocator pages of 2 slots, pages of 4
    held[2 * 3 + 1] = False  # the second half of page 3
    with no_host_sync():
        ok, _ = check_chunk_on_device(_pages(2, 4), PS, 64, None, held, 2)
        bad, _ = check_chunk_on_device(_pages(2, 3), PS, 64, None, held, 2)
        unknown_end, _ = check_chunk_on_device(_pages(5, 5), PS, None)
    assert not bool(ok) and bool(bad) and bool(unknown_end)


def test_out_of_range_pages_are_clamped_before_any_gather():
    from transfer.gather import check_chunk_on_device

    with no_host_sync():
        verdict, pages = check_chunk_on_device(_pages(-3, 40), PS, 16 * PS, torch.zeros(16, dtype=torch.int32),
                                               torch.ones(17, dtype=torch.bool), PS)
    assert pages.tolist() == [0, 15]  # inside the counts; the copy's own check fails these ids

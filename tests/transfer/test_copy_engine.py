import threading

import pytest
import torch
from structlog.testing import capture_logs

from transfer import CpuCopyEngine, CudaCopyEngine, HostPool, KVPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from transfer.gather import page_runs
from tests.support.transfer_helpers import drain

DTYPES = [torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def pools(dtype=torch.bfloat16, mla=False, device="cpu", ps=4):
    heads = 1 if mla else 2
    kv = KVPool(3, heads, 8, dtype, 64, device=device, mla=mla)
    host = HostPool(3, heads, 8, dtype, ps, 32, mla=mla)
    return kv, host


def expected_page(kv, slots, ps):
    """The page-first bytes of device ``slots`` (one page), built independently of the gather."""
    vals = kv.read(slots).cpu()  # [kinds, layers, ps, heads, dim]
    return vals.permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_round_trip_device_host_device(dtype, mla):
    kv, host = pools(dtype, mla)
    eng = CpuCopyEngine()
    slots = torch.arange(8, 20)  # 3 pages
    kv.write(slots, synthetic_kv(kv, 3, torch.arange(12)))
    hp = torch.tensor([5, 2, 3])  # non-consecutive host pages: two runs
    eng.to_host("a", kv, host, slots, hp)
    assert [d.tag for d in drain(eng.poll, 1)] == ["a"]
    for i, p in enumerate(hp.tolist()):
        want = expected_page(kv, slots[i * 4:(i + 1) * 4], 4)
        assert torch.equal(host.page_view(p).view(torch.uint8), want)
    dst = torch.arange(40, 52)
    eng.to_device("b", kv, host, dst, hp)
    assert [d.error for d in drain(eng.poll, 1)] == [None]
    assert torch.equal(kv.read(dst).view(torch.uint8), kv.read(slots).view(torch.uint8))
    eng.close()


def test_completions_out_of_order_each_once():
    kv, host = pools()
    eng = CpuCopyEngine(threads=2)
    gate = threading.Event()
    eng.submit("slow", lambda: gate.wait(10))
    kv.write(torch.arange(4, 8), synthetic_kv(kv, 1, torch.arange(4)))
    eng.to_host("fast", kv, host, torch.arange(4, 8), torch.tensor([0]))
    assert [d.tag for d in drain(eng.poll, 1)] == ["fast"]  # finished before the earlier job
    assert eng.pending == 1
    gate.set()
    assert [d.tag for d in drain(eng.poll, 1)] == ["slow"]
    assert eng.poll() == [] and eng.pending == 0
    eng.close()


def test_failed_job_is_reported_with_error():
    eng = CpuCopyEngine(threads=1)
    eng.submit("bad", lambda: 1 / 0)
    (done,) = drain(eng.poll, 1)
    assert done.tag == "bad" and isinstance(done.error, ZeroDivisionError)
    eng.close()


def test_page_runs():
    assert page_runs(torch.tensor([3, 4, 5, 9, 1, 2])) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert page_runs(torch.tensor([], dtype=torch.int64)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_round_trip(dtype):
    kv, host = pools(dtype, device="cuda")
    assert host.pinned
    eng = CudaCopyEngine()
    slots = torch.arange(8, 20)
    kv.write(slots, synthetic_kv(kv, 3, torch.arange(12)))
    hp = torch.tensor([5, 2, 3])
    eng.to_host("a", kv, host, slots, hp)
    assert [d.tag for d in drain(eng.poll, 1)] == ["a"]
    for i, p in enumerate(hp.tolist()):
        assert torch.equal(host.page_view(p).view(torch.uint8), expected_page(kv, slots[i * 4:(i + 1) * 4], 4))
    dst = torch.arange(40, 52)
    eng.to_device("b", kv, host, dst, hp)
    drain(eng.poll, 1)
    assert torch.equal(kv.read(dst).view(torch.uint8), kv.read(slots).view(torch.uint8))
    eng.close()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ps", [1, 4])
def test_scattered_device_pages_any_host_pages_both_ways(seed, ps):
    """CPU gather (index_select into permuted host views) and scatter: arbitrary device pages,
    host pages in runs and alone, a device pool whose size is not a whole number of pages."""
    g = torch.Generator().manual_seed(seed)
    kv = KVPool(3, 2, 8, torch.bfloat16, 66)  # 66 slots: the last partial page is never used
    host = HostPool(3, 2, 8, torch.bfloat16, ps, 64 // ps * ps)
    n = 5
    dev_pages = torch.randperm(66 // ps, generator=g)[:n]
    single = torch.randperm(host.num_pages - 2, generator=g)[:n - 2]
    run = torch.tensor([host.num_pages - 2, host.num_pages - 1])  # one run of two, the rest alone
    host_pages = torch.cat([single[:1], run, single[1:]])
    slots = (dev_pages.view(-1, 1) * ps + torch.arange(ps)).reshape(-1)
    kv.write(torch.arange(66), synthetic_kv(kv, seed + 1, torch.arange(66)))
    eng = CpuCopyEngine()
    eng.to_host("h", kv, host, slots, host_pages)
    assert [d.error for d in drain(eng.poll, 1)] == [None]
    for i, p in enumerate(host_pages.tolist()):
        assert torch.equal(host.page_view(p).view(torch.uint8), expected_page(kv, slots[i * ps:(i + 1) * ps], ps))
    dst_pages = torch.randperm(66 // ps, generator=g)[:n]
    dst = (dst_pages.view(-1, 1) * ps + torch.arange(ps)).reshape(-1)
    before = kv.read(torch.arange(66)).clone()
    eng.to_device("d", kv, host, dst, host_pages)
    assert [d.error for d in drain(eng.poll, 1)] == [None]
    assert torch.equal(kv.read(dst).view(torch.uint8), before[:, :, slots].contiguous().view(torch.uint8))
    untouched = torch.tensor([s for s in range(66) if s not in set(dst.tolist())])
    assert torch.equal(kv.read(untouched).view(torch.uint8), before[:, :, untouched].contiguous().view(torch.uint8))
    eng.close()


def test_pool_views_are_built_once_and_dropped_with_the_pools():
    import gc
    import weakref

    from transfer.gather import pair_views

    kv, host = pools()
    v = pair_views(kv, host)
    assert pair_views(kv, host) is v
    assert pair_views(kv, HostPool(3, 2, 8, torch.bfloat16, 4, 32)) is not v
    ref = weakref.ref(kv)
    del kv, v
    gc.collect()
    assert ref() is None  # the cache does not keep a pool alive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_close_with_a_timeout_never_synchronizes_on_a_long_copy():
    eng = CudaCopyEngine("cuda")
    eng.submit("long", lambda: torch.cuda._sleep(int(2e9)))  # ~1 s of GPU time on the copy stream
    assert eng.unfinished() == ["long"]
    assert eng.close(timeout=0.01) is False  # returned at the deadline, the kernel still running
    assert eng.unfinished() == ["long"]
    assert [d.tag for d in drain(eng.poll, 1)] == ["long"]  # still reported once it ends
    assert eng.unfinished() == [] and eng.close(timeout=1) is True


def test_cpu_engine_close_reports_whether_its_threads_ended():
    eng = CpuCopyEngine(threads=1)
    gate = threading.Event()
    eng.submit("stuck", gate.wait)
    assert eng.unfinished() == ["stuck"]
    assert eng.close(timeout=0.01) is False and eng.alive()
    gate.set()
    assert [d.tag for d in drain(eng.poll, 1)] == ["stuck"]
    assert eng.close(timeout=5) is True and eng.unfinished() == []


# -- the CPU engine copies host-memory pools only (issue 25, point 6) ---------------------------------
# A pool on another device ('meta' stands in for CUDA here: any device that is not host memory) would
# be read by a worker thread outside any stream order, and the copy reported done at launch.


def test_the_cpu_engine_refuses_a_device_pool_and_queues_nothing():
    kv, host = pools(device="meta")
    eng = CpuCopyEngine(threads=1)
    for copy in (eng.to_host, eng.to_device):
        with pytest.raises(ValueError, match="meta") as err:
            copy("x", kv, host, torch.arange(4, 8), torch.tensor([0]))
        assert type(err.value).__name__ == "DeviceMismatch"
    assert eng.pending == 0 and eng.poll() == []
    eng.close()


def test_an_offloader_with_the_cpu_engine_over_a_device_pool_is_refused_at_construction():
    from transfer import HostOffloader, MemoryStorage

    kv, host = pools(device="meta")
    eng = CpuCopyEngine(threads=1)
    with pytest.raises(ValueError, match="meta"):
        HostOffloader(kv, host, MemoryStorage("_t", host.page_nbytes), copy_engine=eng)
    eng.close()


def test_no_engine_is_made_for_a_device_without_one():
    from transfer import make_copy_engine

    with pytest.raises(ValueError, match="meta"):
        make_copy_engine("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            make_copy_engine("cuda")


def test_a_cuda_launch_failing_half_way_keeps_what_it_built_alive_until_the_event():
    """Issue 25, point 5: the plan (its index and staging tensors, which queued kernels may still
    read) is held by the launch closure from the moment it exists; ``submit`` keeps that closure
    until the copy's event fires, on the error path too. The launch logic runs on CPU here."""
    import gc
    import weakref

    eng = CudaCopyEngine.__new__(CudaCopyEngine)  # no stream needed: _launch only builds and runs
    eng.stream = None
    made = []

    class Plan:
        def to_host(self):
            raise RuntimeError("failed after queuing a gather")

    def make():
        plan = Plan()
        made.append(weakref.ref(plan))
        return plan

    go = eng._launch(make, "to_host")
    with pytest.raises(RuntimeError):
        go()
    gc.collect()
    assert made[0]() is not None  # still alive: the engine holds ``go`` until the event
    del go
    gc.collect()
    assert made[0]() is None


def test_cpu_engine_to_device_reports_its_tag_and_checks_the_slots_when_asked():
    from transfer import BadIndices

    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16, pin=False)
    eng = CpuCopyEngine(threads=1)
    eng.to_device("good", kv, host, torch.arange(8, 12), torch.tensor([1]), check_end=kv.slots)
    eng.to_device("bad", kv, host, torch.arange(9, 13), torch.tensor([1]), check_end=kv.slots)
    done = {d.tag: d for d in drain(eng.poll, 2)}
    assert set(done) == {"good", "bad"}
    assert done["good"].error is None and isinstance(done["bad"].error, BadIndices)
    eng.close()


def test_make_copy_engine_for_the_cpu_defaults_to_two_threads():
    import threading

    from transfer import make_copy_engine

    before = set(threading.enumerate())
    eng = make_copy_engine("cpu")
    new = [t for t in threading.enumerate() if t not in before]
    assert isinstance(eng, CpuCopyEngine) and len(new) == 2
    eng.close()


# --- the copy stream is our own (issue 34, point 4): the factory's logic, on a stand-in runtime -----

class FakeStreamLib:
    """``cudaStreamCreateWithFlags`` / ``cudaStreamDestroy`` (and the driver's names) as ctypes
    calls them: the handle is written through the pointer passed."""

    def __init__(self, rc=0):
        self.rc, self.created, self.destroyed = rc, [], []

    def cudaStreamCreateWithFlags(self, ref, flags):
        self.created.append(flags.value)
        if self.rc == 0:
            ref._obj.value = 0x7F00 + len(self.created)
        return self.rc

    def cudaStreamDestroy(self, handle):
        self.destroyed.append(handle.value)
        return 0

    cuStreamCreate, cuStreamDestroy_v2 = cudaStreamCreateWithFlags, cudaStreamDestroy


@pytest.mark.parametrize("driver", [False, True], ids=["runtime", "driver"])
def test_our_stream_is_created_non_blocking_outside_the_pool_and_destroyed_once(driver):
    from transfer.copy_engine import NON_BLOCKING, OwnStream, StreamApi

    lib = FakeStreamLib()
    pool = []
    own = OwnStream("cuda", api=StreamApi(lib, driver=driver), wrap=lambda h, d: ("external", h, d),
                    pool=pool.append)
    assert NON_BLOCKING == 1 and lib.created == [NON_BLOCKING]  # no implicit sync with the legacy default stream
    assert own.own and own.stream == ("external", 0x7F01, torch.device("cuda")) and pool == []
    own.close()
    own.close()
    assert lib.destroyed == [0x7F01]


def test_without_a_runtime_or_when_creating_fails_a_pool_stream_is_used_and_said_so():
    from transfer.copy_engine import OwnStream, StreamApi

    for api in (None, StreamApi(FakeStreamLib(rc=2))):
        pool = []
        with capture_logs() as logs:
            own = OwnStream("cuda", api=api, wrap=lambda h, d: pytest.fail("nothing to wrap"),
                            pool=lambda d: pool.append(d) or "pool stream")
        assert not own.own and own.stream == "pool stream" and pool == [torch.device("cuda")]
        assert [e["event"] for e in logs] == ["copy_engine.pool_stream"] and logs[0]["log_level"] == "warning"
        own.close()  # nothing of ours to destroy


def test_stream_api_is_none_without_cuda():
    from transfer.copy_engine import stream_api

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA (on a GPU, bench/gpu_check.py checks the stream)")
    assert stream_api() is None


class _Event:
    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired


def test_the_engine_destroys_its_stream_only_once_closed_and_every_copy_has_ended():
    """Never under a copy: a close that times out leaves the stream; the poll that sees the last
    copy end destroys it. The engine's bookkeeping runs on CPU here (events are stand-ins)."""
    from transfer.copy_engine import OwnStream, StreamApi

    lib = FakeStreamLib()
    eng = CudaCopyEngine.__new__(CudaCopyEngine)
    eng._own_stream = OwnStream("cuda", api=StreamApi(lib), wrap=lambda h, d: "stream")
    eng.stream, eng._closed = "stream", False
    event = _Event()
    eng._inflight = [("t", event, (None, None), None)]
    assert eng.poll() == [] and lib.destroyed == []
    assert eng.close(timeout=0.01) is False and lib.destroyed == []  # still queued on it
    assert eng.poll() == [] and lib.destroyed == []
    event.fired = True
    assert [d.tag for d in eng.poll()] == ["t"] and lib.destroyed == [0x7F01]
    assert eng.poll() == [] and lib.destroyed == [0x7F01]


def test_a_launch_holds_its_input_tensors_until_the_event_instead_of_record_stream():
    import gc
    import weakref

    eng = CudaCopyEngine.__new__(CudaCopyEngine)
    eng.stream = None

    class Plan:
        def to_host(self):
            pass

    slots = torch.arange(8)
    ref = weakref.ref(slots)
    go = eng._launch(Plan, "to_host", (slots,))
    del slots
    go()
    gc.collect()
    assert ref() is not None  # held by the launch, which the engine keeps until the event
    del go
    gc.collect()
    assert ref() is None

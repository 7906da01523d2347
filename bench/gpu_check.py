"""The GPU check: everything in this project that only a GPU can show, in one command, in minutes.

Run on a machine with one NVIDIA GPU, from the repository root (``bench/gpu_check.sh`` does this):

    .venv/bin/python bench/gpu_check.py [--quick]

Items, one summary line each (``PASS``, ``FAIL`` or ``INFO``), then an overall line:

1. ``cuda tests``: every test whose name says ``cuda`` (``pytest -k cuda``), none may skip.
2. ``sync-debug suite``: the SGLang decode loop with no device -> host sync on the scheduler thread:
   the CPU stand-in tests and the same loop on the GPU under ``torch.cuda.set_sync_debug_mode("error")``.
3. ``round trip``: device -> host -> device through the CUDA copy engine, slot ids on the device,
   MHA and MLA, bf16 and fp8, compared byte for byte.
4. ``simulate``: ``kv-lifecycle simulate --device cuda --verify all`` (exit 0: no leak, no double
   free, every stored page read back equal to the KV it came from).
5. ``d2h throughput``: a chunk's gather + D2H into the pinned host pool against a pinned ``copy_``
   of the same bytes (informational; target >= 0.90 of the baseline).
6. ``layered copy``: the SGLang engine over per-layer buffers (64-layer MHA, 61-layer MLA), with
   SGLang's all-layer kernel when ``sgl_kernel`` imports (said on the line when it does not) and
   on the staged path through a two-page staging budget: bit-exact both ways, a bad chunk a failed
   copy, the staging buffer within its budget; the scheduler thread's time per chunk (INFO).

Then SGLang's decode offload over an SGLang-shaped 64-layer MHA stack on the GPU (issue 34: what
only a GPU shows of a first deployment), each its own line (``SGLANG_ITEMS``):

7. ``offload queued``: ``offload_kv_cache`` timed with 200 ms of work queued on the current stream:
   < 5 ms (a sync of any kind, PyTorch-visible or not, would wait for the queued work).
8. ``chunk launches``: a stride chunk's call timed and its kernel launches and copies counted with
   the profiler, at 64 and at 4 layers (informational: what grows with depth).
9. ``retract resume``: a request retracted after 2,000 decoded tokens and resumed: its first chunk
   is its whole generated part; ``torch.cuda.memory_reserved()`` grows by less than the staging cap
   (+ 16 MiB for indices) and its pages land.
10. ``repeated page``: a row listing one page twice: a failed copy, nothing stored (the device-side
    chunk check).
11. ``own stream``: the copy engine's stream is not one SGLang's scheduler uses (forward, result
    copy, schedule: drawn as SGLang draws them) nor any of the next 64 pool streams.
12. ``held copy exit``: a copy held back by work queued before it, then
    ``release_host_resources(timeout_s=0.01)``: no raise, the host pool still pinned, and no
    ``cudaHostUnregister`` of it at interpreter exit (in a process of its own).

13. ``vllm engine``: a whole vLLM 0.32.0 ``LLM(load_format="dummy", skip_tokenizer_init=True)`` engine on
    the GPU with the connector loaded by module path (``tests/integrations/vllm/test_llm.py``, with and
    without async scheduling): the pages stored are exactly the decode pages its forwards wrote, each
    page's bytes what vLLM's KV blocks held. ``SKIP`` (not counted as passed) when vLLM does not import
    (on a GPU machine: ``pip install vllm==0.32.0``, the project's ``vllm`` extra).

``--list`` prints the items and exits 0 (no GPU needed). Exit codes: 0 every item passed; 1 an
item failed; 3 no CUDA device here (nothing was checked).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NO_CUDA = 3


def line(item: str, verdict: str, detail: str) -> None:
    print(f"gpu_check | {item:<16} | {verdict:<4} | {detail}", flush=True)


def _pytest(args: list[str], timeout: int, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run pytest on ``args`` in a child (``env``: variables added to this process's), at most
    ``timeout`` s. Returns its exit code and output."""
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs", *args]
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s"
    return out.returncode, out.stdout + out.stderr


def _counts(text: str) -> dict[str, int]:
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)}


def _pytest_item(item: str, rc: int, out: str, note: str, need_passed: bool = True) -> bool:
    """An item that is a pytest run: PASS when it exited 0 with nothing failed or skipped (and, with
    ``need_passed``, something passed); its line; on a FAIL the run's last lines on stderr."""
    c = _counts(out)
    ok = rc == 0 and (c.get("passed", 0) > 0 or not need_passed) and not c.get("skipped") and not c.get("failed")
    line(item, "PASS" if ok else "FAIL",
         f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped {note}")
    if not ok:
        print(out[-4000:], file=sys.stderr)
    return ok


def cuda_tests(timeout: int) -> bool:
    rc, out = _pytest(["tests", "-k", "cuda and not without_cuda"], timeout)
    return _pytest_item("cuda tests", rc, out, f"(rc {rc})")


def sync_suite(timeout: int) -> bool:
    rc, out = _pytest(["tests/integrations/test_sglang_no_sync.py", "tests/transfer/test_device_indices.py",
                       "tests/transfer/test_gather_staged.py"], timeout)
    return _pytest_item("sync-debug suite", rc, out, "(stand-in + set_sync_debug_mode('error'))", need_passed=False)


def round_trip() -> bool:
    import torch

    from tests.support.transfer_helpers import drain
    from transfer import CudaCopyEngine, HostPool, KVPool
    from lifecycle_tools.testkit.kv_pattern import synthetic_kv

    ps, done = 16, []
    try:
        for mla in (False, True):
            for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                heads = 1 if mla else 8
                kv = KVPool(4, heads, 128, dtype, 64 * ps, device="cuda", mla=mla)
                host = HostPool(4, heads, 128, dtype, ps, 16 * ps, mla=mla)
                kv.write(torch.arange(64 * ps), synthetic_kv(kv, 7, torch.arange(64 * ps)))
                eng = CudaCopyEngine("cuda")
                pages = torch.tensor([3, 9, 10, 40], device="cuda")
                slots = (pages.view(-1, 1) * ps + torch.arange(ps, device="cuda")).reshape(-1)
                hp = torch.tensor([2, 3, 7, 8])
                eng.to_host(1, kv, host, slots, hp, check_end=kv.slots)
                assert [d.error for d in drain(eng.poll, 1)] == [None]
                want = kv.read(slots).cpu()
                for i, p in enumerate(hp.tolist()):
                    page = want[:, :, i * ps:(i + 1) * ps].permute(0, 2, 1, 3, 4).contiguous()
                    assert torch.equal(host.page_view(p).view(torch.uint8), page.view(torch.uint8)), (mla, dtype, p)
                dst = (torch.tensor([50, 51, 5, 60], device="cuda").view(-1, 1) * ps
                       + torch.arange(ps, device="cuda")).reshape(-1)
                eng.to_device(2, kv, host, dst, hp, check_end=kv.slots)
                assert [d.error for d in drain(eng.poll, 1)] == [None]
                assert torch.equal(kv.read(dst).cpu().view(torch.uint8), want.view(torch.uint8)), (mla, dtype)
                eng.close()
                done.append(f"{'mla' if mla else 'mha'} {str(dtype).split('.')[-1]}")
    except Exception as err:  # reported on the item's line
        line("round trip", "FAIL", f"after {', '.join(done) or 'nothing'}: {err!r}")
        return False
    line("round trip", "PASS", f"D2H and H2D bit-exact, device slot ids: {', '.join(done)}")
    return True


def simulate(requests: int, timeout: int) -> bool:
    cmd = [sys.executable, "-m", "lifecycle_tools.cli", "simulate", "--device", "cuda", "--verify", "all",
           "--requests", str(requests)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        line("simulate", "FAIL", f"timed out after {timeout}s")
        return False
    ok = out.returncode == 0
    line("simulate", "PASS" if ok else "FAIL",
         f"--device cuda --verify all --requests {requests}: exit {out.returncode} in {time.monotonic() - t0:.0f}s")
    if not ok:
        print((out.stdout + out.stderr)[-4000:], file=sys.stderr)
    return ok


def throughput(repeats: int) -> bool:
    import torch

    from transfer import HostPool, KVPool
    from transfer.gather import ChunkCopy, Staging

    layers, heads, dim, dtype, ps, chunk, pool_tokens, rounds = 32, 8, 128, torch.bfloat16, 16, 256, 8192, 16
    kv = KVPool(layers, heads, dim, dtype, pool_tokens, device="cuda")
    kv.buffer.fill_(1.0)
    host = HostPool(layers, heads, dim, dtype, ps, chunk)
    if not host.pinned:
        line("d2h throughput", "FAIL", "the host pool is not pinned")
        return False
    staging, stream = Staging("cuda"), torch.cuda.Stream()
    g = torch.Generator().manual_seed(0)
    slots = []
    for _ in range(rounds):
        pages = torch.randperm(pool_tokens // ps - 1, generator=g)[:chunk // ps] + 1
        slots.append((pages.view(-1, 1) * ps + torch.arange(ps)).reshape(-1).cuda())
    nbytes = host.buffer.numel() * host.buffer.element_size()
    src = torch.ones((rounds, host.buffer.numel()), dtype=dtype, device="cuda")
    dst = host.buffer.view(-1)

    def ours(i):
        with torch.cuda.stream(stream):
            ChunkCopy(kv, host, slots[i], torch.arange(chunk // ps), check_end=kv.slots, staging=staging).to_host()
        stream.synchronize()

    def base(i):
        with torch.cuda.stream(stream):
            dst.copy_(src[i], non_blocking=True)
        stream.synchronize()

    t_ours, t_base = [], []
    for i in range(3 + repeats):
        for fn, acc in ((ours, t_ours), (base, t_base)):
            t0 = time.perf_counter()
            fn(i % rounds)
            if i >= 3:
                acc.append(time.perf_counter() - t0)
    a, b = nbytes / statistics.median(t_ours) / 1e9, nbytes / statistics.median(t_base) / 1e9
    line("d2h throughput", "INFO",
         f"gather+D2H {a:.1f} GB/s vs pinned copy_ {b:.1f} GB/s: {a / b:.2f} (target >= 0.90), "
         f"{nbytes / 1e6:.0f} MB chunk, median of {repeats}")
    return True


def layered_copy(chunks: int) -> bool:
    """The SGLang engine over per-layer buffers (64-layer MHA, 61-layer MLA): SGLang's all-layer
    kernel when ``sgl_kernel`` imports, and the staged path with a two-page staging budget (a chunk
    of eight pages goes in four pieces): D2H and H2D bit-exact, a bad chunk a failed copy, the
    staging buffer within its budget, and the scheduler thread's time per chunk."""
    import torch

    from lifecycle.integrations.sglang.device_pool import LayeredKVPool
    from lifecycle.integrations.sglang.layered_copy import load_kernel, make_layered_copy_engine
    from tests.support.transfer_helpers import drain
    from transfer import BadIndices, HostPool

    module = load_kernel()
    ps, pool_pages, done, timings = 16, 256, [], []
    paths = [("kernel", module)] if module is not None else []
    paths.append(("staged", False))
    try:
        for mla, layers in ((False, 64), (True, 61)):
            heads, dim = (1, 576) if mla else (8, 128)
            gen = torch.Generator(device="cuda").manual_seed(3)
            kv = LayeredKVPool([[torch.randn(pool_pages * ps, heads, dim, device="cuda", generator=gen)
                                 .to(torch.bfloat16) for _ in range(layers)] for _ in range(1 if mla else 2)], mla=mla)
            host = HostPool(layers, heads, dim, kv.dtype, ps, 32 * ps, mla=mla)
            assert host.pinned, "the host pool is not pinned"
            pages = torch.tensor([3, 9, 10, 40, 41, 42, 7, 100], device="cuda")
            slots = (pages.view(-1, 1) * ps + torch.arange(ps, device="cuda")).reshape(-1)
            hp = torch.tensor([2, 3, 7, 8, 9, 10, 11, 20])
            want = kv.read(slots).cpu()
            for name, kernel in paths:
                budget = 2 * host.page_nbytes
                eng = make_layered_copy_engine(kv, kernel=kernel, staging_bytes=budget)
                assert (eng.kernel is not None) == (name == "kernel"), name
                host.buffer.zero_()
                eng.to_host(1, kv, host, slots, hp, check_end=kv.slots)
                assert [d.error for d in drain(eng.poll, 1)] == [None]
                for i, p in enumerate(hp.tolist()):
                    page = want[:, :, i * ps:(i + 1) * ps].transpose(1, 2).contiguous()
                    assert torch.equal(host.page_view(p).view(torch.uint8), page.view(torch.uint8)), (name, mla, p)
                dst = ((torch.tensor([50, 51, 5, 60, 61, 62, 63, 200], device="cuda").view(-1, 1) * ps)
                       + torch.arange(ps, device="cuda")).reshape(-1)
                eng.to_device(2, kv, host, dst, hp, check_end=kv.slots)
                assert [d.error for d in drain(eng.poll, 1)] == [None]
                assert torch.equal(kv.read(dst).cpu().view(torch.uint8), want.view(torch.uint8)), (name, mla)
                bad = torch.arange(kv.slots - 8, kv.slots + 8, device="cuda")  # past the pool: clamped, refused
                eng.to_host(3, kv, host, bad, torch.tensor([30]), check_end=kv.slots)
                assert [type(d.error) for d in drain(eng.poll, 1)] == [BadIndices], (name, mla)
                if name == "staged":
                    assert 0 < eng.staging_buffer.peak_bytes <= budget, eng.staging_buffer.peak_bytes
                one = slots[:ps]
                torch.cuda.synchronize()
                spent = []
                for i in range(chunks):
                    t0 = time.perf_counter()
                    eng.to_host(10 + i, kv, host, one, hp[:1], check_end=kv.slots)
                    spent.append(time.perf_counter() - t0)
                drain(eng.poll, chunks)
                eng.close()
                timings.append(f"{name} {'mla' if mla else 'mha'}-{layers}: {statistics.median(spent) * 1e3:.3f} ms")
                done.append(f"{name} {'mla' if mla else 'mha'}-{layers}")
    except Exception as err:  # reported on the item's line
        line("layered copy", "FAIL", f"after {', '.join(done) or 'nothing'}: {err!r}")
        return False
    line("layered copy", "PASS", f"bit-exact both ways, bad chunk refused, staging within budget: {', '.join(done)}")
    line("layered copy", "INFO", "scheduler thread per one-page chunk (median): " + "; ".join(timings)
         + ("" if module is not None else "; sgl_kernel not importable: the kernel path was NOT checked"))
    return True


# --- SGLang's decode offload over an SGLang-shaped 64-layer MHA stack (issue 34) --------------------

#: the items ``sglang_checks`` prints, in order, with what each catches (``--list``)
SGLANG_ITEMS = {
    "offload queued": "offload_kv_cache with 200 ms of work queued on the current stream returns in < 5 ms",
    "chunk launches": "a stride chunk's call timed, its kernel launches and copies counted (profiler), 64 vs 4 layers",
    "retract resume": "retracted after 2,000 tokens and resumed: memory_reserved() grows by less than the staging cap",
    "repeated page": "a row listing a page twice: a failed copy, nothing stored",
    "own stream": "the copy stream is none of SGLang's scheduler streams nor the next 64 pool streams",
    "held copy exit": "a held-back copy, release_host_resources(timeout_s=0.01): no raise, still pinned, "
                      "no unregister at exit",
}
#: every item's name, in the order the lines come
ITEMS = ("cuda tests", "sync-debug suite", "round trip", "layered copy", "simulate", "d2h throughput", *SGLANG_ITEMS,
         "vllm engine")
MODEL, HEADS, DIM, PS = "org/Model-70B", 8, 128, 16


def _node(layers: int, tokens: int = 4096, rows: int = 8, max_len: int = 2304):
    """SGLang-shaped pools on the GPU (the doubles: SGLang's classes need a whole server)."""
    from tests.integrations.sglang_kit import Node, doubles_kit

    return Node(doubles_kit(), page_size=PS, layers=layers, heads=HEADS, dim=DIM, tokens=tokens, rows=rows,
                max_len=max_len, device="cuda")


def _manager(node, store: str):
    """The drop-in, constructed as SGLang's scheduler constructs it."""
    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
    from lifecycle_tools.testkit.sglang_doubles import runtime_context

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = store
    os.environ.pop("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", None)
    with use_runtime(runtime_context(page_size=PS, model=MODEL)):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


def _drain(mgr, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not mgr.idle():
        if time.monotonic() > deadline:
            raise TimeoutError("the offload did not drain")
        mgr.check_offload_progress()
        time.sleep(0.001)
    mgr.check_offload_progress()


def _finish(mgr, req) -> None:
    req.finished_reason = "length"
    if not mgr.offload_kv_cache(req):
        mgr.finalize_release_on_finish(req)
    _drain(mgr)


def _sleep_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``seconds`` of GPU time on this device (calibrated)."""
    import torch

    n = int(2e7)
    torch.cuda._sleep(n)  # its kernel loaded
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize()
    return int(n * seconds / max(time.perf_counter() - t0, 1e-6))


def _offload_queued(mgr, node) -> bool:
    import torch

    req = node.admit("q", list(range(PS)), 64)
    node.decode_tokens(req, PS)
    mgr.offload_kv_cache(req)  # warm: kernels loaded, staging made
    _drain(mgr)
    node.decode_tokens(req, PS)
    cycles = _sleep_cycles(0.2)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # 200 ms of work queued on the current stream
    t0 = time.perf_counter()
    accepted = mgr.offload_kv_cache(req)
    dt = time.perf_counter() - t0
    _drain(mgr)
    ok = accepted and dt < 0.005
    line("offload queued", "PASS" if ok else "FAIL",
         f"offload_kv_cache {dt * 1e3:.2f} ms with 200 ms queued on the current stream (< 5 ms: no sync); "
         f"accepted {accepted}")
    _finish(mgr, req)
    return ok


def _launches(mgr, node, rid: str) -> tuple[float, int, int]:
    """One stride chunk of a fresh request: the call's seconds, its kernel launches and copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    req = node.admit(rid, list(range(PS)), 64)
    node.decode_tokens(req, PS)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        mgr.offload_kv_cache(req)
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    kernels = sum(1 for n in names if n in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                            "cuLaunchKernelEx"))
    copies = sum(1 for n in names if n.startswith("cudaMemcpy"))
    _drain(mgr)
    _finish(mgr, req)
    return dt, kernels, copies


def _chunk_launches(mgr, node, small_mgr, small) -> bool:
    _launches(mgr, node, "warm-64")  # first calls load kernels
    _launches(small_mgr, small, "warm-4")
    dt, k, c = _launches(mgr, node, "l64")
    dt4, k4, c4 = _launches(small_mgr, small, "l4")
    line("chunk launches", "INFO",
         f"one stride chunk ({PS} tokens), the call on the scheduler thread: 64 layers {dt * 1e3:.2f} ms, "
         f"{k} kernel launches, {c} copies; 4 layers {dt4 * 1e3:.2f} ms, {k4} launches, {c4} copies "
         f"(SGLang's transfer_kv_all_layer: 1 launch)")
    return True


def _retract_resume(mgr, node) -> bool:
    import torch

    from lifecycle.integrations.sglang.install import _release_hook
    from lifecycle_tools.testkit.sglang_doubles import release_kv_cache

    cap = getattr(getattr(mgr.offloader.engine, "staging_buffer", None), "budget_bytes", 16 << 20)
    req = node.admit("long", list(range(PS)), 4000)
    node.decode_tokens(req, 2000)  # 2,000 tokens decoded, none offloaded yet
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)  # retract_decode: SGLang frees
    req.reset_for_retract()
    node.pool.alloc([req])  # resume_retracted_reqs: a new row, the KV restored
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    stored = mgr.offloader.stats().pages_stored
    accepted = mgr.offload_kv_cache(req)  # the first chunk: the whole generated part
    _drain(mgr)
    grown = torch.cuda.memory_reserved() - before
    pages = mgr.offloader.stats().pages_stored - stored
    ok = accepted and grown <= cap + (16 << 20) and pages >= 2000 // PS - 1
    line("retract resume", "PASS" if ok else "FAIL",
         f"first chunk after resume: {pages} pages stored, memory_reserved() +{grown / 2**20:.1f} MiB "
         f"(staging cap {cap / 2**20:.0f} MiB + 16 MiB)")
    _finish(mgr, req)
    return ok


def _repeated_page(mgr, node) -> bool:
    req = node.admit("dup", list(range(PS)), 64)
    node.decode_tokens(req, 2 * PS)
    row = req.kv.req_pool_idx
    good = node.pool.req_to_token[row].clone()
    node.pool.req_to_token[row, 2 * PS:3 * PS] = node.pool.req_to_token[row, PS:2 * PS].clone()
    fails, stored = mgr.stats().copy_failures, mgr.offloader.stats().pages_stored
    accepted = mgr.offload_kv_cache(req)  # one chunk of both pages (two strides due)
    _drain(mgr)
    node.pool.req_to_token[row] = good  # as it was, for SGLang's free path
    _finish(mgr, req)
    failed, landed = mgr.stats().copy_failures - fails, mgr.offloader.stats().pages_stored - stored
    ok = accepted and (failed, landed) == (1, 0)
    line("repeated page", "PASS" if ok else "FAIL",
         f"a chunk listing one page twice: {failed} failed copies, {landed} pages stored (want 1 and 0)")
    return ok


def _own_stream(store: str) -> bool:
    import torch

    node = _node(layers=2, tokens=256)
    forward = torch.cuda.Stream()  # ModelRunner.forward_stream: drawn before the manager
    mgr = _manager(node, store)  # Scheduler.__init__ builds the offload manager ...
    copy = torch.cuda.Stream()  # ... then its copy_stream, then, at the event loop, schedule_stream
    schedule = torch.cuda.Stream(priority=0)
    while schedule.cuda_stream == forward.cuda_stream:
        schedule = torch.cuda.Stream(priority=0)
    later = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    engine = mgr.offloader.engine
    ours = engine.stream.cuda_stream
    clash = [n for n, h in (("forward", forward.cuda_stream), ("copy", copy.cuda_stream),
                            ("schedule", schedule.cuda_stream)) if h == ours] + (["pool"] if ours in later else [])
    own = getattr(getattr(engine, "_own_stream", None), "own", False)
    ok = own and not clash
    line("own stream", "PASS" if ok else "FAIL",
         f"copy stream {ours:#x} ({'ours' if own else 'from the pool'}); the same as: {', '.join(clash) or 'none'} "
         f"of SGLang's forward / copy / schedule streams and the next 64 pool streams")
    mgr.release_host_resources()
    return ok


def held_copy_exit_child(store: str) -> None:
    """Item 12 in a process of its own (``--held-copy-exit DIR``): hold a copy back, shut down at
    0.01 s, print what happened, and (through a wrapper of the CUDA runtime) any unregister at exit."""
    import torch

    from transfer import host_pool as host_pool_mod

    phase = ["during-run"]
    real = host_pool_mod._cudart

    class Cudart:
        def __getattr__(self, name):
            return getattr(real(), name)

        def cudaHostUnregister(self, ptr):
            print(f"unregister {phase[0]}", flush=True)
            return real().cudaHostUnregister(ptr)

    host_pool_mod._cudart = lambda: Cudart()
    node = _node(layers=4, tokens=1024)
    mgr = _manager(node, store)
    req = node.admit("held", list(range(PS)), 64)
    node.decode_tokens(req, PS)
    cycles = _sleep_cycles(3.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # the copy waits behind 3 s of work on the current stream
    mgr.offload_kv_cache(req)
    req.finished_reason = "abort"
    mgr.finalize_release_on_finish(req)
    try:
        mgr.release_host_resources(timeout_s=0.01)
        print("raised no", flush=True)
    except BaseException as err:  # noqa: BLE001 (what the promise is about)
        print(f"raised {err!r}", flush=True)
    print(f"pinned {mgr.decode_host_mem_pool.pinned} abandoned {mgr.stats().abandoned}", flush=True)
    held_copy_exit_child.keep = (mgr, node)  # alive until the interpreter exits
    phase[0] = "at-exit"


def held_copy_verdict(rc: int, stdout: str) -> bool:
    """Whether item 12's process said what it must: no raise, still pinned, one copy abandoned, and
    no unregister at all (during the run or at exit)."""
    return rc == 0 and stdout.splitlines() == ["raised no", "pinned True abandoned 1"]


def _held_copy_exit(store: str) -> bool:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--held-copy-exit", store]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        line("held copy exit", "FAIL", "timed out after 90s")
        return False
    ok = held_copy_verdict(out.returncode, out.stdout)
    line("held copy exit", "PASS" if ok else "FAIL",
         f"release_host_resources(timeout_s=0.01) under a held copy: {' / '.join(out.stdout.splitlines()) or 'no output'}"
         f" (exit {out.returncode}; want no raise, pinned, 1 abandoned, no unregister even at exit)")
    if not ok:
        print(out.stderr[-3000:], file=sys.stderr)
    return ok


def sglang_checks(store_root: str) -> list[bool]:
    """Items 7-12 (``SGLANG_ITEMS``), one line each; an item that raises is a FAIL."""
    import torch

    try:
        node = _node(layers=64)
        mgr = _manager(node, os.path.join(store_root, "s64"))
        small = _node(layers=4)
        small_mgr = _manager(small, os.path.join(store_root, "s4"))
    except Exception as err:  # noqa: BLE001 (reported on the items' lines)
        for item in SGLANG_ITEMS:
            line(item, "FAIL", f"the SGLang-shaped stacks could not be built: {err!r}")
        return [False] * len(SGLANG_ITEMS)
    kv_bytes = sum(b.numel() * b.element_size() for b in node.kv.k_buffer + node.kv.v_buffer)
    line("sglang stack", "INFO", f"64-layer MHA, {HEADS} heads x {DIM}, bf16, page {PS}: {kv_bytes / 2**30:.1f} GiB "
                                 f"device KV, host pool {mgr.decode_host_mem_pool.num_pages} pages")
    steps = [("offload queued", lambda: _offload_queued(mgr, node)),
             ("chunk launches", lambda: _chunk_launches(mgr, node, small_mgr, small)),
             ("retract resume", lambda: _retract_resume(mgr, node)),
             ("repeated page", lambda: _repeated_page(mgr, node)),
             ("own stream", lambda: _own_stream(os.path.join(store_root, "stream"))),
             ("held copy exit", lambda: _held_copy_exit(os.path.join(store_root, "held")))]
    results = []
    for item, step in steps:
        try:
            results.append(step())
        except Exception as err:  # noqa: BLE001 (reported on the item's line)
            line(item, "FAIL", repr(err))
            results.append(False)
    for m in (mgr, small_mgr):
        m.release_host_resources()
    del node, small
    torch.cuda.empty_cache()
    return results


def vllm_engine(timeout: int) -> bool | None:
    """Item 13: the connector inside a whole vLLM engine on the GPU; None (SKIP) without vLLM."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure: not installed here
        line("vllm engine", "SKIP", f"vLLM does not import ({type(err).__name__}): pip install vllm==0.32.0 to check it")
        return None
    rc, out = _pytest(["tests/integrations/vllm/test_llm.py"], timeout,
                      env={"KV_LIFECYCLE_REQUIRE_VLLM": "1"})   # a skip inside is a failure here
    return _pytest_item("vllm engine", rc, out, "(LLM(load_format='dummy') with the connector, sync and async scheduling)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer simulate requests and throughput repeats")
    ap.add_argument("--list", action="store_true", help="print the items and exit (no GPU needed)")
    ap.add_argument("--held-copy-exit", metavar="DIR", help=argparse.SUPPRESS)  # item 12's own process
    args = ap.parse_args()
    if args.list:
        for item in ITEMS:
            print(f"gpu_check | {item:<16} | {SGLANG_ITEMS.get(item, 'see the module docstring')}")
        return 0
    if args.held_copy_exit:
        held_copy_exit_child(args.held_copy_exit)
        return 0
    try:
        import torch
    except ImportError:
        line("environment", "FAIL", "torch is not importable: install the project first (see bench/gpu_check.sh)")
        return 1
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build of torch)"
        line("environment", "SKIP", f"no CUDA device: torch {torch.__version__}, CUDA build {build}; "
                                    "nothing was checked (this needs one NVIDIA GPU)")
        return NO_CUDA
    line("environment", "INFO", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                                f"CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
    t0 = time.monotonic()
    results = [
        cuda_tests(timeout=150),
        sync_suite(timeout=90),
        round_trip(),
        layered_copy(50 if args.quick else 200),
        simulate(100 if args.quick else 300, timeout=120),
        throughput(10 if args.quick else 40),
    ]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as store_root:
        results += sglang_checks(store_root)
    engine = vllm_engine(timeout=150)
    if engine is not None:   # SKIP (no vLLM here) is neither passed nor failed
        results.append(engine)
    failed = results.count(False)
    line("overall", "PASS" if not failed else "FAIL",
         f"{len(results) - failed}/{len(results)} items passed in {time.monotonic() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

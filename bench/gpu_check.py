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

Exit codes: 0 every item passed; 1 an item failed; 3 no CUDA device here (nothing was checked).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NO_CUDA = 3


def line(item: str, verdict: str, detail: str) -> None:
    print(f"gpu_check | {item:<16} | {verdict:<4} | {detail}", flush=True)


def _pytest(args: list[str], timeout: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s"
    return out.returncode, out.stdout + out.stderr


def _counts(text: str) -> dict[str, int]:
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)}


def cuda_tests(timeout: int) -> bool:
    rc, out = _pytest(["tests", "-k", "cuda and not without_cuda"], timeout)
    c = _counts(out)
    ok = rc == 0 and c.get("passed", 0) > 0 and not c.get("skipped") and not c.get("failed")
    line("cuda tests", "PASS" if ok else "FAIL",
         f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped (rc {rc})")
    if not ok:
        print(out[-4000:], file=sys.stderr)
    return ok


def sync_suite(timeout: int) -> bool:
    rc, out = _pytest(["tests/integrations/test_sglang_no_sync.py", "tests/transfer/test_device_indices.py",
                       "tests/transfer/test_gather_staged.py"], timeout)
    c = _counts(out)
    ok = rc == 0 and not c.get("skipped") and not c.get("failed")
    line("sync-debug suite", "PASS" if ok else "FAIL",
         f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped "
         f"(stand-in + set_sync_debug_mode('error'))")
    if not ok:
        print(out[-4000:], file=sys.stderr)
    return ok


def round_trip() -> bool:
    import torch

    from tests.support.transfer_helpers import drain
    from transfer import CudaCopyEngine, HostPool, KVPool, synthetic_kv

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer simulate requests and throughput repeats")
    args = ap.parse_args()
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
        simulate(100 if args.quick else 300, timeout=150),
        throughput(10 if args.quick else 40),
    ]
    failed = results.count(False)
    line("overall", "PASS" if not failed else "FAIL",
         f"{len(results) - failed}/{len(results)} items passed in {time.monotonic() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

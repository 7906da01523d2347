"""What stays registered with the Mooncake client, and what bounding it costs (issue 22, point 5).

A caller that hands ``MooncakeStorage`` fresh big page tensors on every call (each a new tensor
storage of >= 1 MiB) used to get every one of them registered and referenced until ``close``. Three
ways, each in its own child process against one real ``mooncake_master`` (started here):

  * ``keep-all``: every big storage kept registered (the old behaviour: ``max_kept=None``);
  * ``lru``: an LRU of registrations, at most ``DEFAULT_MAX_KEPT`` idle big storages kept (the
    least recently used one unregistered and released; the host pool, used by every call, stays);
  * ``staging``: a registered staging buffer: each fresh tensor is copied into it before
    ``batch_set`` and out of it after ``batch_get`` (the store only ever sees staging views).

Per round: ``--pages`` fresh pages of ``--page-mib`` MiB written, read back into fresh tensors,
then deleted (the segment stays small). Reported: median round time (ms), RSS growth from round 2
to the last (MiB), big storages still registered at the end. Plus, for each mode, the host-pool
case (pages are views of one pool tensor; no fresh storages): median round time.

Run: .venv/bin/python bench/bench_mooncake_registrations.py [--rounds 37] [--pages 2] [--page-mib 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

MODES = ("keep-all", "lru", "staging")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> dict:
    """One mode in this process; prints one JSON line."""
    import torch

    from transfer.storage.spec import open_storage

    nb = args.page_mib << 20
    store = open_storage(f"mooncake://{args.master}?global_segment_size=256MiB", "_bench_0_1", nb)
    buffers = store._buffers
    if args.mode == "keep-all":
        buffers.max_kept = None
    staging = torch.zeros(args.pages, nb, dtype=torch.uint8) if args.mode == "staging" else None
    pool = torch.zeros(max(4, args.pages), nb, dtype=torch.uint8)
    n = 0

    def keys(k):
        nonlocal n
        n += 1
        return [hashlib.sha256(f"{args.mode}-{n}-{i}".encode()).hexdigest() for i in range(k)]

    def round_fresh() -> float:
        pages = [torch.full((nb,), (n + i) % 251, dtype=torch.uint8) for i in range(args.pages)]
        outs = [torch.empty(nb, dtype=torch.uint8) for _ in range(args.pages)]
        ks = keys(args.pages)
        t0 = time.perf_counter()
        if staging is None:
            assert store.batch_set(ks, pages) == [True] * args.pages
            assert store.batch_get(ks, outs) == [True] * args.pages
        else:
            for i, p in enumerate(pages):
                staging[i].copy_(p)
            assert store.batch_set(ks, [staging[i] for i in range(args.pages)]) == [True] * args.pages
            assert store.batch_get(ks, [staging[i] for i in range(args.pages)]) == [True] * args.pages
            for i, o in enumerate(outs):
                o.copy_(staging[i])
        dt = time.perf_counter() - t0
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
        for k in ks:
            store.delete(k)
        return dt

    def round_pool() -> float:
        ks = keys(args.pages)
        views = [pool[i] for i in range(args.pages)]
        t0 = time.perf_counter()
        assert store.batch_set(ks, views) == [True] * args.pages
        assert store.batch_get(ks, views) == [True] * args.pages
        dt = time.perf_counter() - t0
        for k in ks:
            store.delete(k)
        return dt

    fresh_times, rss = [], []
    for _ in range(args.rounds):
        fresh_times.append(round_fresh())
        rss.append(rss_mib())
    pool_times = [round_pool() for _ in range(args.rounds)]
    out = {"mode": args.mode, "fresh_ms": 1e3 * statistics.median(fresh_times[1:]),
           "rss_growth_mib": rss[-1] - rss[1], "kept": buffers.kept,
           "kept_mib": buffers.kept_bytes / (1 << 20), "registrations": buffers.registrations,
           "pool_ms": 1e3 * statistics.median(pool_times[1:])}
    store.close(wait=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=37)
    ap.add_argument("--pages", type=int, default=2)
    ap.add_argument("--page-mib", type=int, default=2)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--master")
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    from lifecycle_tools.testkit.mooncake_server import mooncake_dir, require_mooncake, start_master

    require_mooncake()
    master = start_master(mooncake_dir())
    rows = []
    try:
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--master", master.address, "--rounds",
                   str(args.rounds), "--pages", str(args.pages), "--page-mib", str(args.page_mib)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = [x for x in done.stdout.splitlines() if x.startswith("{")]
            if done.returncode or not line:
                raise SystemExit(f"{mode} failed: {done.stderr[-2000:]}")
            rows.append(json.loads(line[-1]))
    finally:
        master.stop()
    print(f"{args.rounds} rounds of {args.pages} fresh {args.page_mib} MiB pages (set + get), then the host-pool case")
    print("| mode | fresh tensors: ms/round | RSS growth MiB | big storages still registered (MiB) "
          "| registrations | host pool: ms/round |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['fresh_ms']:.2f} | {r['rss_growth_mib']:+.1f} | {r['kept']} ({r['kept_mib']:.0f}) "
              f"| {r['registrations']} | {r['pool_ms']:.2f} |")


if __name__ == "__main__":
    main()

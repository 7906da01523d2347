"""Soak: many simulated requests through the real stack with random faults; nothing may leak.

    .venv/bin/python bench/soak.py [--requests 100000] [--round 2000] [--seed 0] [--json PATH]

One long-lived stack and manager (file storage in a temp dir, LRU-bounded so its index does not
grow without end) serve rounds of requests from the
reference scheduler (``lifecycle_tools.simulate``): short prompts and outputs on a tiny model so the
lifecycle, not the arithmetic, is exercised. Faults, all random and seeded:

* storage writes fail (``OSError(ENOSPC)`` from the store's ``batch_set``) with probability
  ``--storage-fail``;
* a small host pool, so ``host_short`` happens whenever copies pile up;
* aborts and retractions (with readmission) mid-decode;
* stuck copies: when the offloader supports ``write_timeout_s``, a tiny deadline expires some
  copies, whose slots stay quarantined until they end.

Per round: requests/s, leaks (slots, rows, host pages, manager records), double frees, pages
verified on read-back, RSS; at the end: peak RSS, RSS growth after warm-up, and the cycle
collector's pauses after the warm-up round (``gc.callbacks``): count per generation, and the
generation-2 (full collection) pause p50 / p99 / max.

Freeze after warm-up (default; ``--no-freeze`` to compare): after the first round the heap is
collected once and frozen (``gc.freeze()``), as an embedding scheduler should do once its process
is warm (SGLang's ``freeze_gc``): the ~170k objects of torch and friends move to the permanent
generation, so a full collection walks only what was allocated since (docs/integration.md).
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

import torch  # noqa: E402

from lifecycle import DecodeOffloadManager  # noqa: E402
from lifecycle_tools import simulate  # noqa: E402
from transfer import build_stack  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class GcPauses:
    """Every collection's pause (ms) by generation, while ``on``."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.on = False
        self._t0 = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            self.pauses[info["generation"]].append((time.perf_counter() - self._t0) * 1e3)

    def summary(self) -> dict:
        full = sorted(self.pauses[2])
        pick = lambda q: full[min(len(full) - 1, int(len(full) * q))] if full else 0.0  # noqa: E731
        return dict(gc_collections={f"gen{g}": len(p) for g, p in self.pauses.items()},
                    gc_gen0_1_pause_max_ms=max(self.pauses[0] + self.pauses[1], default=0.0),
                    gc_gen2_collections=len(full), gc_gen2_pause_p50_ms=pick(0.5),
                    gc_gen2_pause_p99_ms=pick(0.99), gc_gen2_pause_max_ms=full[-1] if full else 0.0,
                    gc_frozen_objects=gc.get_freeze_count(), gc_tracked_objects_end=len(gc.get_objects()))


def flaky(batch_set, rng: random.Random, p: float, counter: list):
    def batch_set_or_fail(keys, pages):
        if rng.random() < p:
            counter[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return batch_set(keys, pages)

    return batch_set_or_fail


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--round", type=int, default=2_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--storage-fail", type=float, default=0.02)
    ap.add_argument("--copy-timeout", type=float, default=0.02,
                    help="copy deadline in seconds (default %(default)s: some copies expire, most land and "
                         "their pages are verified; at 0.0005 nearly every copy expires and nothing is verified)")
    ap.add_argument("--store-capacity", type=int, default=16 << 20,
                    help="LRU bound of the file store in bytes, so its index stays bounded too")
    ap.add_argument("--no-freeze", dest="freeze", action="store_false",
                    help="do not gc.freeze() after the warm-up round (to measure what freezing saves)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="kv-soak-")
    cfg = simulate.SimConfig(
        layers=1, heads=1, head_dim=16, dtype="fp16", page_size=4, device_tokens=16_384,
        host_tokens=256, rows=96, requests=args.round, turns=1, system_prompt=8, prompt_len="4-40",
        output_len="4-40", arrival_rate=0.0, think_steps=0, abort_frac=0.05, retract_frac=0.05,
        seed=args.seed, storage=f"file:{tmp.name}", reuse=False, verify="64", prefill_budget=4096,
    )
    max_len = simulate.prepare(cfg)
    stack = build_stack(cfg.layers, cfg.heads, cfg.head_dim, torch.float16, cfg.page_size, cfg.device_tokens,
                        cfg.host_tokens, cfg.rows, max_len, storage=cfg.storage_spec, model_name=cfg.model_name(),
                        storage_capacity_bytes=args.store_capacity)
    mgr = DecodeOffloadManager.from_stack(stack)
    rng = random.Random(args.seed)
    injected = [0]
    stack.storage.batch_set = flaky(stack.storage.batch_set, rng, args.storage_fail, injected)
    if hasattr(stack.offloader, "write_timeout_s") and args.copy_timeout > 0:
        stack.offloader.write_timeout_s = args.copy_timeout
    sim = simulate.Simulator(cfg, stack, mgr)
    gcp = GcPauses()
    rounds = []
    totals = dict(requests=0, slots_leaked=0, rows_leaked=0, host_pages_leaked=0, manager_leaked=0,
                  manager_unreleased=0, double_frees=0, lifecycle_errors=0, verify_ok=0,
                  verify_mismatched=0, storage_failures=0, host_short=0)
    t_all = time.perf_counter()
    n_rounds = max(1, args.requests // args.round)
    try:
        for i in range(n_rounds):
            cfg.seed = args.seed * 1_000 + i
            rep = sim.run_pass(simulate.iter_chats(cfg, prefix=f"s{i}-"), f"round{i}", total=cfg.requests)
            row = dict(round=i, requests=rep.requests, req_per_s=rep.requests / rep.wall_s,
                       rss_mib=rss_mib(), problems=rep.problems())
            for k in totals:
                totals[k] += getattr(rep, k)
            rounds.append(row)
            if i == 0:  # warm-up done: collect once, freeze what is left, count pauses from here
                if args.freeze:
                    gc.collect()
                    gc.freeze()
                gcp.on = True
            print(f"round {i:3d}: {rep.requests} requests, {row['req_per_s']:7.0f} req/s, "
                  f"RSS {row['rss_mib']:7.1f} MiB, storage failures {rep.storage_failures}, "
                  f"host short {rep.host_short}, verified {rep.verify_ok}/{rep.verify_sampled}, "
                  f"problems: {row['problems'] or 'none'}", flush=True)
    finally:
        sim.close()
        deadline = time.perf_counter() + 60
        while not mgr.idle() and time.perf_counter() < deadline:
            mgr.check_offload_progress()
            time.sleep(0.001)
        s = mgr.stats()
        mgr.shutdown(force=not mgr.idle())
        stack.close()
        tmp.cleanup()
    wall = time.perf_counter() - t_all
    warm = rounds[min(2, len(rounds) - 1)]["rss_mib"]
    summary = dict(
        totals, rounds=len(rounds), wall_s=wall, req_per_s=totals["requests"] / wall,
        injected_storage_faults=injected[0], copies_expired=s.copies_expired,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rss_after_warmup_mib=warm, rss_final_mib=rounds[-1]["rss_mib"],
        rss_growth_after_warmup_mib=rounds[-1]["rss_mib"] - warm, gc_freeze_after_warmup=args.freeze,
        **gcp.summary(),
    )
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(dict(summary=summary, rounds=rounds), indent=1))
    bad = any(totals[k] for k in ("slots_leaked", "rows_leaked", "host_pages_leaked", "manager_leaked",
                                  "manager_unreleased", "double_frees", "verify_mismatched"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

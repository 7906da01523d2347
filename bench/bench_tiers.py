"""Storage tiers side by side on the same pages: file, Redis, Redis Cluster, Mooncake.

Starts everything it uses on free 127.0.0.1 ports (a ``redis-server``, a 3-master Redis Cluster, a
``mooncake_master`` and a standalone ``mooncake_client`` segment holder) and stops them at the end.

Table 1, per page size (64 KiB, 1 MiB): ``batch_set`` then ``batch_get`` GB/s of ``TOTAL`` bytes
of page tensors (batches of ``BATCH`` pages, every page sealed and verified), median of ``--reps``
repetitions after one warm-up, the tiers interleaved in a rotating order within each repetition:
  * same process: this process writes and reads back (Mooncake: ``preferred_segment=local``,
    so the objects are in this process's own segment — the client's memory);
  * cross process: a child process writes the pages and exits, this process reads them (Mooncake:
    both use no segment of their own, so the objects live on the holder and every byte crosses
    processes over TCP; file: the page cache; Redis: as always, the server process).
Baseline row ``mooncake (bare client)``: the Mooncake client alone on the same pages in the same
process (``RawMooncake``: what SGLang does, without our existence check, seal and verification).
Table 2: Mooncake aggregate throughput with 1, 2 and 4 client processes sharing one master, each
contributing a segment (placement is random across segments, so most transfers cross processes),
each writing then reading its own ``TOTAL`` bytes; aggregate GB/s = all bytes / wall time.
Run: .venv/bin/python bench/bench_tiers.py [--reps N] [--total-mib N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from transfer.storage.identity import DeploymentIdentity  # noqa: E402
from transfer.storage.spec import open_storage  # noqa: E402

BATCH = 32  # pages per batch call
SIZES = [64 << 10, 1 << 20]
IDENTITY = DeploymentIdentity(model_name="bench")  # suffix _bench_0_1; Mooncake objects bench_{hash}_0_k/_v


def keys_for(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def make_pages(nbytes: int, n: int, seed: int) -> torch.Tensor:
    """``n`` pages in one pool-like tensor (what a host pool is: registered once by Mooncake)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def batched(call, keys, pages) -> float:
    """Seconds to run ``call(keys, pages)`` (a store's batch_set / batch_get) batch by batch."""
    t = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        assert all(call(keys[i:i + BATCH], list(pages[i:i + BATCH]))), f"a page failed in {call.__name__}"
    return time.perf_counter() - t


def put_all(store, keys, pool) -> float:
    return batched(store.batch_set, keys, pool)


def get_all(store, keys, out) -> float:
    return batched(store.batch_get, keys, out)


def worker(spec: str, nbytes: int, n: int, tag: str, mode: str) -> None:
    """Child process: ``write`` pages under ``tag`` and exit; or ``setget``: say ``ready``, wait for a
    line on stdin, write then read back, print the timings, and stay (its segment holds others'
    objects) until stdin closes."""
    store = open_storage(spec, page_nbytes=nbytes, identity=IDENTITY)
    try:
        pool, keys = make_pages(nbytes, n, hash(tag) & 0xFFFF), keys_for(tag, n)
        if mode == "setget":
            print("ready", flush=True)
            sys.stdin.readline()
        t_set = put_all(store, keys, pool)
        t_get = get_all(store, keys, torch.empty_like(pool)) if mode == "setget" else 0.0
        print(json.dumps({"set": t_set, "get": t_get}), flush=True)
        if mode == "setget":
            sys.stdin.read()
    finally:
        store.close(**({"wait": True} if spec.startswith("mooncake://") else {}))


def run_worker(spec: str, nbytes: int, n: int, tag: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, "--worker", spec, str(nbytes), str(n), tag, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


class RawMooncake:
    """Baseline: the bare Mooncake client on the same pages, as SGLang drives it (K and V halves
    zero-copy from one registered pool, ``batch_put_from`` / ``batch_get_into``) — no existence
    check, no seal, no verification, no return-code mapping."""

    def __init__(self, master: str) -> None:
        from transfer.storage.mooncake.conn import import_store

        store_cls, cfg_cls = import_store()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.store = store_cls()
        assert self.store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 30, 0, "tcp", "", master) == 0
        self.cfg = cfg_cls()
        self.cfg.preferred_segments = [self.store.get_hostname()]
        self.registered: list[torch.Tensor] = []

    def _args(self, keys, pages):
        for t in pages:
            base = t.untyped_storage()
            if not any(r.untyped_storage().data_ptr() == base.data_ptr() for r in self.registered):
                self.store.register_buffer(base.data_ptr(), base.nbytes())
                self.registered.append(t)
        half = pages[0].numel() // 2
        names = [f"{k}_0_{kv}" for k in keys for kv in "kv"]
        ptrs = [t.data_ptr() + h * half for t in pages for h in (0, 1)]
        return names, ptrs, [half] * len(names)

    def batch_set(self, keys, pages):
        return [c == 0 for c in self.store.batch_put_from(*self._args(keys, pages), self.cfg)[::2]]

    def batch_get(self, keys, pages):
        return [c > 0 for c in self.store.batch_get_into(*self._args(keys, pages))[::2]]

    def delete(self, key):
        for kv in "kv":
            self.store.remove(f"{key}_0_{kv}", True)

    def close(self):
        self.store.close()


class Tiers:
    """The servers and the specs of every tier (same process and cross process)."""

    def __init__(self) -> None:
        from lifecycle_tools.testkit.mooncake_server import SegmentHolder, mooncake_dir, start_master
        from lifecycle_tools.testkit.redis_cluster import RedisCluster, cli_binary
        from lifecycle_tools.testkit.redis_server import server_binary, start_server

        self.tmp = tempfile.mkdtemp(prefix="kvl-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.redis = start_server(server_binary())
        self.cluster = RedisCluster(server_binary(), cli_binary()).start()
        self.master = start_master(mooncake_dir())
        self.holder = SegmentHolder(mooncake_dir(), self.master, 1 << 30).start()
        self.same = {"file": f"file:{self.tmp}/same", "redis": self.redis.url, "redis-cluster": self.cluster.url,
                     "mooncake": self.master.spec(global_segment_size="1GiB", preferred_segment="local")}
        self.cross = {"file": f"file:{self.tmp}/cross", "redis": self.redis.url, "redis-cluster": self.cluster.url,
                      "mooncake": self.master.spec(global_segment_size=0)}

    def close(self) -> None:
        import shutil

        self.holder.stop(1.0)
        self.master.stop()
        self.cluster.close()
        self.redis.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def drop(store, keys) -> None:
    for k in keys:
        store.delete(k)


def one_rep(tiers: Tiers, stores: dict, nbytes: int, n: int, rep: int) -> dict[str, dict[str, float]]:
    """Seconds of set/get per tier, same process and cross process, tiers in a rotating order."""
    names = list(stores)
    names = [x for x in names if not x.startswith("cross:")]
    names = names[rep % len(names):] + names[:rep % len(names)]
    pool, out = make_pages(nbytes, n, rep + 1000), torch.empty(n, nbytes, dtype=torch.uint8)
    res: dict[str, dict[str, float]] = {}
    for name in names:
        store, tag = stores[name], f"{name}-{nbytes}-{rep}-{time.time_ns()}"
        keys = keys_for(tag, n)
        t_set = put_all(store, keys, pool)
        t_get = get_all(store, keys, out)
        assert torch.equal(out[-1], pool[-1])
        drop(store, keys)
        if name not in tiers.cross:
            res[name] = {"set": t_set, "get": t_get, "xget": float("nan")}
            continue
        child = run_worker(tiers.cross[name], nbytes, n, "x" + tag, "write")
        child.communicate("", timeout=300)
        assert child.returncode == 0, f"{name} writer failed"
        reader = stores["cross:" + name]
        xkeys = keys_for("x" + tag, n)
        t_xget = get_all(reader, xkeys, out)
        drop(reader, xkeys)
        res[name] = {"set": t_set, "get": t_get, "xget": t_xget}
    return res


def tier_table(tiers: Tiers, reps: int, total: int) -> None:
    stores = {name: open_storage(spec, identity=IDENTITY) for name, spec in tiers.same.items()}
    stores.update({"cross:" + name: open_storage(spec, identity=IDENTITY) for name, spec in tiers.cross.items()})
    stores["mooncake (bare client)"] = RawMooncake(tiers.master.address)
    try:
        print(f"\nTable 1: {total >> 20} MiB per tier per repetition, batches of {BATCH} pages, median of {reps} "
              "(GB/s = 1e9 page bytes/s)")
        print("| page | tier | set GB/s (same process) | get GB/s (same process) | get GB/s (written by another process) |")
        print("|---|---|---|---|---|")
        for nbytes in SIZES:
            n = total // nbytes
            one_rep(tiers, stores, nbytes, n, -1)  # warm-up: connections, registrations, page cache
            runs = [one_rep(tiers, stores, nbytes, n, rep) for rep in range(reps)]
            for name in [*tiers.same, "mooncake (bare client)"]:
                med = {m: statistics.median(r[name][m] for r in runs) for m in ("set", "get", "xget")}
                gb = n * nbytes / 1e9
                cross = "-" if med["xget"] != med["xget"] else f"{gb / med['xget']:.2f}"  # nan: not measured
                print(f"| {nbytes >> 10} KiB | {name} | {gb / med['set']:.2f} | {gb / med['get']:.2f} | {cross} |",
                      flush=True)
    finally:
        for s in stores.values():
            s.close()


def scale_table(tiers: Tiers, reps: int, total: int, nbytes: int = 1 << 20) -> None:
    print(f"\nTable 2: Mooncake, N client processes on one master, each with a 256 MiB segment, each "
          f"writing then reading {total >> 20} MiB of {nbytes >> 10} KiB pages; median of {reps}")
    print("| clients | aggregate set GB/s | aggregate get GB/s | per-client set GB/s | per-client get GB/s |")
    print("|---|---|---|---|---|")
    spec = tiers.master.spec(global_segment_size="256MiB")
    n = total // nbytes
    for clients in (1, 2, 4):
        sets, gets = [], []
        for rep in range(reps):
            procs = [run_worker(spec, nbytes, n, f"scale{clients}-{rep}-{c}-{time.time_ns()}", "setget")
                     for c in range(clients)]
            for p in procs:  # all set up (setup holds the GIL for a while), then all start together
                assert p.stdout.readline().strip() == "ready", "a client did not start"
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            times = [json.loads(p.stdout.readline()) for p in procs]
            for p in procs:  # everyone has read its pages: segments may go
                p.communicate(timeout=120)
            # processes run concurrently: aggregate over the slowest one's time
            sets.append(clients * n * nbytes / max(t["set"] for t in times) / 1e9)
            gets.append(clients * n * nbytes / max(t["get"] for t in times) / 1e9)
        s, g = statistics.median(sets), statistics.median(gets)
        print(f"| {clients} | {s:.2f} | {g:.2f} | {s / clients:.2f} | {g / clients:.2f} |", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, spec, nbytes, n, tag, mode = sys.argv
        worker(spec, int(nbytes), int(n), tag, mode)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=32)
    ap.add_argument("--skip-scale", action="store_true")
    args = ap.parse_args()
    from bench.perfkit import machine

    print(machine())
    tiers = Tiers()
    try:
        tier_table(tiers, args.reps, args.total_mib << 20)
        if not args.skip_scale:
            scale_table(tiers, args.reps, args.total_mib << 20)
    finally:
        tiers.close()


if __name__ == "__main__":
    main()

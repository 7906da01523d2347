"""RedisStorage batch set/get vs a plain redis-py pipeline of the same bytes, same server, same run.

Starts its own ``redis-server`` (free port on 127.0.0.1, no persistence) and stops it at the end.
For each page size, the same pages are written and read back two ways, interleaved (the order
alternates each repetition), ``--reps`` times, and the median of each is printed side by side:
  * ``pipe``:  plain redis-py (default client: hiredis parser when installed), one
    non-transactional pipeline of ``SET`` / ``GET`` per batch of ``BATCH`` pages, the pages'
    raw bytes prepared beforehand (``bytes`` objects: no tensor, no header, no check);
  * ``store``: ``RedisStorage.batch_set`` / ``batch_get`` per batch from/into page tensors
    (104-byte seal per page with its XXH3-128 digest, ``SET NX``; on read each reply is received
    from the socket straight into the caller's page tensor and its seal verified there).
Every repetition uses fresh keys on an emptied server. ``--sweep`` also times ``batch_set`` /
``batch_get`` for several ``pipeline_bytes`` settings (how the default was chosen).
Run: .venv/bin/python bench/bench_redis.py [--reps N] [--sizes KIB,...] [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import redis  # noqa: E402

from lifecycle_tools.testkit.redis_server import server_binary, start_server  # noqa: E402
from transfer.storage.redis.store import RedisStorage  # noqa: E402

TOTAL = 32 << 20  # page bytes moved per page size per direction per repetition
BATCH = 32  # pages per batch call (a 512-token chunk at page size 16)
SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def keys_for(tag: str, n: int) -> list[str]:
    return [f"{hash((tag, i)) & (2**256 - 1):064x}" for i in range(n)]


def one_rep(url: str, nbytes: int, rep: int, pipeline_bytes: int | None = None) -> dict[str, tuple[float, float]]:
    """(set seconds, get seconds) for ``pipe`` and ``store`` on the same pages."""
    n = TOTAL // nbytes
    g = torch.Generator().manual_seed(nbytes + rep)
    pages = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]
    raw = [p.numpy().tobytes() for p in pages]
    out = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(n)]  # touched, as a host pool is
    batches = [range(i, min(i + BATCH, n)) for i in range(0, n, BATCH)]
    client = redis.Redis.from_url(url, socket_timeout=30)
    kw = {} if pipeline_bytes is None else {"pipeline_bytes": pipeline_bytes}
    store = RedisStorage(url, "_bench", nbytes, socket_timeout_s=30, **kw)
    pk, sk = keys_for(f"pipe{rep}", n), keys_for(f"store{rep}", n)

    def pipe_set():
        for b in batches:
            p = client.pipeline(transaction=False)
            for i in b:
                p.set(pk[i], raw[i])
            p.execute()

    def pipe_get():
        for b in batches:
            p = client.pipeline(transaction=False)
            for i in b:
                p.get(pk[i])
            p.execute()

    def store_set():
        for b in batches:
            assert all(store.batch_set([sk[i] for i in b], [pages[i] for i in b]))

    def store_get():
        for b in batches:
            assert all(store.batch_get([sk[i] for i in b], [out[i] for i in b]))

    client.flushall()
    res: dict[str, list[float]] = {"pipe": [0.0, 0.0], "store": [0.0, 0.0]}
    order = [("pipe", pipe_set, pipe_get), ("store", store_set, store_get)]
    if rep % 2:
        order.reverse()
    for name, fset, _ in order:
        res[name][0] = timed(fset)
    for name, _, fget in order:
        res[name][1] = timed(fget)
    assert all(torch.equal(a, b) for a, b in zip(pages[:4], out[:4]))
    client.flushall()
    client.close()
    store.close()
    return {k: (v[0], v[1]) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(str(x >> 10) for x in SIZES), help="page sizes in KiB")
    ap.add_argument("--sweep", action="store_true", help="also time several pipeline_bytes settings")
    args = ap.parse_args()
    sizes = [int(x) << 10 for x in args.sizes.split(",")]
    binary = server_binary()
    if binary is None:
        sys.exit("redis-server not found (apt-get install redis-server)")
    server = start_server(binary)
    try:
        import hiredis
        parser = f"hiredis {hiredis.__version__}"
    except ImportError:
        parser = "pure-Python parser (no hiredis)"
    version = redis.Redis.from_url(server.url).info("server")["redis_version"]
    print(f"redis-server {version} on {server.url}; redis-py {redis.__version__} with {parser}; "
          f"torch {torch.__version__}")
    print(f"{TOTAL >> 20} MiB per size per direction, batches of {BATCH} pages, {args.reps} interleaved "
          f"repetitions: median (best) GB/s, GB/s = 1e9 page bytes/s; ratio = pipe time / store time")
    print("| page | pipe set GB/s | store set GB/s | set ratio | pipe get GB/s | store get GB/s | get ratio |")
    print("|---|---|---|---|---|---|---|")
    try:
        for nbytes in sizes:
            runs = [one_rep(server.url, nbytes, rep) for rep in range(args.reps)]
            gb = TOTAL / 1e9
            cells = []
            for d in (0, 1):  # set, get
                med = [statistics.median(r[m][d] for r in runs) for m in ("pipe", "store")]
                best = [min(r[m][d] for r in runs) for m in ("pipe", "store")]
                cells += [f"{gb / med[0]:.2f} ({gb / best[0]:.2f})", f"{gb / med[1]:.2f} ({gb / best[1]:.2f})",
                          f"**{med[0] / med[1]:.2f}** ({best[0] / best[1]:.2f})"]
            print(f"| {nbytes >> 10} KiB | " + " | ".join(cells) + " |")
        if args.sweep:
            print("\npipeline_bytes sweep (store only, median set/get GB/s)")
            print("| page | pipeline_bytes | set GB/s | get GB/s |")
            print("|---|---|---|---|")
            for nbytes in (64 << 10, 1 << 20):
                for pb in (1 << 20, 4 << 20, 8 << 20, 32 << 20):
                    runs = [one_rep(server.url, nbytes, rep, pb)["store"] for rep in range(args.reps)]
                    s, g = (statistics.median(r[d] for r in runs) for d in (0, 1))
                    print(f"| {nbytes >> 10} KiB | {pb >> 20} MiB | {TOTAL / s / 1e9:.2f} | {TOTAL / g / 1e9:.2f} |")
    finally:
        server.close()


if __name__ == "__main__":
    main()

"""RedisStorage batch set/get vs plain redis-py over loopback, same bytes, same server, same run.

Starts its own ``redis-server`` (free port on 127.0.0.1, no persistence) and stops it at the end.
For each page size, the same pages are written and read back three ways:
  * ``loop``:  a plain redis-py ``SET`` / ``GET`` per page (one round trip each), raw bytes;
  * ``pipe``:  plain redis-py, one pipeline of ``SET`` / ``GET`` per batch, raw bytes;
  * ``store``: ``RedisStorage.batch_set`` / ``batch_get`` per batch (header + crc32 per page,
    ``SET NX``, verified on read and copied into the caller's page buffers).
Each round uses fresh keys on an emptied server; best of ``ROUNDS`` rounds is reported.
Run: .venv/bin/python bench/bench_redis.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import redis  # noqa: E402

from lifecycle_tools.testkit.redis_server import server_binary, start_server  # noqa: E402
from transfer.storage.redis import RedisStorage  # noqa: E402

TOTAL = 64 << 20  # bytes moved per page size per direction per round
BATCH = 32  # pages per batch call (a 512-token chunk at page size 16)
ROUNDS = 3
SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_size(url: str, nbytes: int, rnd: int) -> dict[str, tuple[float, float]]:
    n = TOTAL // nbytes
    g = torch.Generator().manual_seed(nbytes + rnd)
    pages = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]
    raw = [p.numpy().tobytes() for p in pages]
    out = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    batches = [range(i, min(i + BATCH, n)) for i in range(0, n, BATCH)]
    client = redis.Redis.from_url(url, socket_timeout=30)
    store = RedisStorage(url, "_bench", nbytes, socket_timeout_s=30)
    res = {}

    def keys(tag):
        return [f"{tag}{rnd}:{i}" for i in range(n)]

    client.flushall()
    k = keys("loop")
    t_set = timed(lambda: [client.set(k[i], raw[i]) for i in range(n)])
    t_get = timed(lambda: [client.get(k[i]) for i in range(n)])
    res["loop"] = (t_set, t_get)

    client.flushall()
    k = keys("pipe")

    def pipe_set():
        for b in batches:
            p = client.pipeline(transaction=False)
            for i in b:
                p.set(k[i], raw[i])
            p.execute()

    def pipe_get():
        for b in batches:
            p = client.pipeline(transaction=False)
            for i in b:
                p.get(k[i])
            p.execute()
    res["pipe"] = (timed(pipe_set), timed(pipe_get))

    client.flushall()
    k = keys("store")

    def store_set():
        for b in batches:
            assert all(store.batch_set([k[i] for i in b], [pages[i] for i in b]))

    def store_get():
        for b in batches:
            assert all(store.batch_get([k[i] for i in b], [out[i] for i in b]))
    res["store"] = (timed(store_set), timed(store_get))
    assert all(torch.equal(a, b) for a, b in zip(pages[:4], out[:4]))
    client.flushall()
    client.close()
    store.close()
    return res


def main() -> None:
    binary = server_binary()
    if binary is None:
        sys.exit("redis-server not found (apt-get install redis-server)")
    server = start_server(binary)
    version = redis.Redis.from_url(server.url).info("server")["redis_version"]
    print(f"redis-server {version} on {server.url}; redis-py {redis.__version__}; torch {torch.__version__}")
    print(f"{TOTAL >> 20} MiB per size per direction, batches of {BATCH} pages, best of {ROUNDS}")
    print("| page | method | set pages/s | set GB/s | get pages/s | get GB/s |")
    print("|---|---|---|---|---|---|")
    try:
        for nbytes in SIZES:
            best: dict[str, list[float]] = {}
            for rnd in range(ROUNDS):
                for name, (ts, tg) in run_size(server.url, nbytes, rnd).items():
                    b = best.setdefault(name, [float("inf"), float("inf")])
                    b[0], b[1] = min(b[0], ts), min(b[1], tg)
            n = TOTAL // nbytes
            for name in ("loop", "pipe", "store"):
                ts, tg = best[name]
                print(f"| {nbytes >> 10} KiB | {name} | {n / ts:,.0f} | {TOTAL / ts / 1e9:.2f} | "
                      f"{n / tg:,.0f} | {TOTAL / tg / 1e9:.2f} |")
    finally:
        server.close()


if __name__ == "__main__":
    main()

"""The bounded model check at larger bounds than the regular suite runs.

    .venv/bin/python bench/model_check.py [--requests 2] [--chunks 4] [--host-pages 3] [--aborts] [--faults]

``--faults`` adds the buggy-scheduler actions (row moved or cleared, bad over-allocation, foreign
manager, re-entrant call, shared offloader, coarser allocator page; see the model's docstring).

Prints distinct abstract states, events (edges) explored, maximal traces covered and wall time for
page sizes 1 and 4, with and without speculative over-allocation.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

from lifecycle_tools.testkit.lifecycle_model import Config, explore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--host-pages", type=int, default=3)
    ap.add_argument("--aborts", action="store_true")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--max-states", type=int, default=2_000_000)
    args = ap.parse_args()
    for page in (1, 4):
        for spec in (0, 3):
            cfg = Config(requests=args.requests, chunks=args.chunks, page_size=page, spec=spec,
                         host_pages=args.host_pages, aborts=args.aborts, faults=args.faults)
            t0 = time.perf_counter()
            states, edges, traces = explore(cfg, max_states=args.max_states)
            print(f"page={page} spec={spec} requests={args.requests} chunks={args.chunks} "
                  f"host_pages={args.host_pages} aborts={args.aborts} faults={args.faults}: {states} states, {edges} events, "
                  f"{traces} traces, {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

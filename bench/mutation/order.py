"""pytest plugin for the mutation campaign: a mutant's tests run cheapest first.

mutmut hands each mutant's run the tests that called the mutated function, in set order, and the
run stops at the first failure (``-x``). Most mutants are killed by a fast unit test of their own
module, so a run that meets a 5 s end-to-end test first pays for it on every kill. This plugin
orders the collected tests by the durations mutmut measured in its stats run
(``mutmut-stats.json`` in the working directory, which is the snapshot's ``mutants/``): test files
by their summed duration, ascending, and within a file tests by duration, ascending. A file's tests
stay together, so module-scoped fixtures (a Redis server, a Mooncake master) are set up once.

Outcomes do not change: a mutant survives only if every selected test passes, in any order (the
suite is order-independent; mutmut's clean run, which uses this order too, checks it). Loaded by
``bench/mutation/campaign.py`` with ``-p bench.mutation.order``; without a stats file it leaves the order
alone (the stats run itself).
"""

from __future__ import annotations

import json
from pathlib import Path

STATS = Path("mutmut-stats.json")


def cheapest_first(nodeids: list[str], durations: dict[str, float]) -> list[int]:
    """Positions of ``nodeids`` in run order: files by summed duration, then tests by duration
    (ties keep the given order; a test without a measured duration counts as 0 s)."""
    by_file: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        by_file.setdefault(nodeid.split("::", 1)[0], []).append(i)
    cost = {f: sum(durations.get(nodeids[i], 0.0) for i in idx) for f, idx in by_file.items()}
    order: list[int] = []
    for f in sorted(by_file, key=lambda f: cost[f]):  # sorted() is stable: ties keep first-seen order
        order += sorted(by_file[f], key=lambda i: durations.get(nodeids[i], 0.0))
    return order


def pytest_collection_modifyitems(session, config, items) -> None:
    try:
        durations = json.loads(STATS.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    items[:] = [items[i] for i in cheapest_first([item.nodeid for item in items], durations)]

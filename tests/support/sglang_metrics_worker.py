"""A scheduler process as SGLang runs it with ``--enable-metrics``: ``PROMETHEUS_MULTIPROC_DIR`` set
before ``prometheus_client`` is imported; our manager constructed as SGLang's scheduler does and
driven by its decode loop. Writes the manager's final ``NodeStats`` as JSON to argv[1]."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

assert os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def main(out: str) -> None:
    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
    from lifecycle.node_stats import collect
    from lifecycle_tools.testkit.sglang_doubles import runtime_context
    from tests.integrations.sglang_kit import Node, doubles_kit

    node = Node(doubles_kit())
    ctx = runtime_context(page_size=node.ps, model="org/Model-7B")
    observability = SimpleNamespace(enable_metrics=True)
    ctx.get_observability = lambda: observability
    with use_runtime(ctx):
        mgr = DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                          tp_group=None, tree_cache=node.tree)
    reqs = [node.admit(rid, prompt, n) for rid, prompt, n in (("a", list(range(10, 23)), 11), ("b", [5] * 9, 14))]
    running = list(reqs)
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.release_host_resources()
    stats = collect(mgr.manager, offloader=mgr.offloader, storage=mgr.storage)
    with open(out, "wb") as f:
        f.write(stats.to_json())


if __name__ == "__main__":
    main(sys.argv[1])

"""A pass's totals from the manager's, offloader's and storage's counters (deltas over the pass)."""

from __future__ import annotations

from lifecycle.node_stats import from_stack
from lifecycle_tools.simulate.calls import EnqueueTimer
from lifecycle_tools.simulate.report import PassReport
from lifecycle_tools.simulate.state import PassState
from lifecycle_tools.stats import percentile


def tally_pass(rep: PassReport, ps: PassState, mgr, stack, enqueue: EnqueueTimer) -> None:
    """Fill ``rep``'s offload, storage, rate and timing figures (``ps.before`` holds the
    ``NodeStats`` taken when the pass began)."""
    b, now = ps.before, from_stack(mgr, stack)   # lifecycle.node_stats.NodeStats: the numbers the metrics show
    mgr0, off0, sto0, pre0 = b.manager, b.offloader, b.tiers[0].storage, b.prefix
    s, off, sto, pre = now.manager, now.offloader, now.tiers[0].storage, now.prefix
    rep.chunks_offloaded = s.chunks_enqueued - mgr0.chunks_enqueued
    rep.chunks_landed = s.chunks_landed - mgr0.chunks_landed
    rep.chunks_failed = (s.copy_failures - mgr0.copy_failures) + (s.copies_expired - mgr0.copies_expired)
    rep.pages_offloaded = s.pages_enqueued - mgr0.pages_enqueued
    rep.bytes_offloaded = rep.pages_offloaded * now.page_nbytes
    wall = rep.wall_s or float("inf")
    rep.offload_mib_s = rep.bytes_offloaded / 2**20 / wall
    rep.requests_per_s = rep.requests / wall
    rep.host_short = s.host_short - mgr0.host_short
    rep.storage_ops = off.storage_ops - off0.storage_ops
    rep.storage_failures = off.storage_failed - off0.storage_failed
    rep.pages_stored = off.pages_stored - off0.pages_stored
    rep.storage_pages_written = sto.stored - sto0.stored
    rep.storage_pages_skipped = sto.skipped - sto0.skipped
    rep.prefix_lookups_failed += sum(getattr(pre, f) - getattr(pre0, f) for f in ("failed", "timed_out", "skipped"))
    rep.prefix_hit_rate = rep.prefix_pages_hit / rep.prefix_pages_looked_up if rep.prefix_pages_looked_up else 0.0
    rep.overhead_us_p50 = percentile(ps.overhead_us, 50)
    rep.overhead_us_p99 = percentile(ps.overhead_us, 99)
    rep.overhead_us_max = max(ps.overhead_us, default=0.0)
    rep.enqueue_us_p50 = percentile(enqueue.samples_us, 50)
    rep.enqueue_us_p99 = percentile(enqueue.samples_us, 99)

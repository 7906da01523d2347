"""What a run reports: per-pass counters (``PassReport``), the run (``RunReport``) and the summary
table the command prints. Units: bytes in MiB, rates in MiB/s, times in microseconds or seconds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_ERRORS = 100   # error messages kept per pass; the rest are counted in errors_dropped


@dataclass
class PassReport:
    """Counters of one pass over the workload (see ``format_summary`` for what each means)."""

    name: str = "run"
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0
    readmitted: int = 0
    steps: int = 0
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    tokens_decoded: int = 0
    prompt_tokens_computed: int = 0
    chunks_offloaded: int = 0
    chunks_landed: int = 0
    chunks_failed: int = 0
    pages_offloaded: int = 0
    bytes_offloaded: int = 0
    offload_mib_s: float = 0.0
    storage_ops: int = 0
    storage_failures: int = 0
    pages_stored: int = 0
    storage_pages_written: int = 0
    storage_pages_skipped: int = 0
    host_short: int = 0
    prefill_backup_pages: int = 0
    prefill_backup_failures: int = 0
    prefix_lookups: int = 0
    prefix_lookups_failed: int = 0
    prefix_pages_looked_up: int = 0
    prefix_pages_hit: int = 0
    prefix_hit_rate: float = 0.0
    prefix_bytes_loaded: int = 0
    prefix_pages_verified: int = 0
    prefix_mismatches: int = 0
    prefix_loads_short: int = 0
    prefix_pages_unstaged: int = 0
    overhead_us_p50: float = 0.0
    overhead_us_p99: float = 0.0
    overhead_us_max: float = 0.0
    enqueue_us_p50: float = 0.0
    enqueue_us_p99: float = 0.0
    rows_admitted: int = 0
    rows_freed: int = 0
    slots_leaked: int = 0
    rows_leaked: int = 0
    host_pages_leaked: int = 0
    manager_leaked: int = 0
    manager_unreleased: int = 0
    double_frees: int = 0
    lifecycle_errors: int = 0
    errors: list[str] = field(default_factory=list)
    errors_dropped: int = 0
    verify_population: int = 0
    verify_sampled: int = 0
    verify_ok: int = 0
    verify_mismatched: int = 0
    verify_missing: int = 0
    verify_unavailable: int = 0
    verify_refused_corrupt: int = 0     # sampled pages the store refused at verification: seal/digest mismatch
    verify_refused_foreign: int = 0     # ... another page's or format's seal, or another size
    pages_refused_corrupt: int = 0      # every read of the pass (prefix loads + verification), from the store
    pages_refused_foreign: int = 0
    pages_served_unverified: int = 0    # pages the store served without a seal (no integrity check)
    storage_evictions: int = 0          # pages the store evicted under its capacity bound (its own count)
    drained: bool = True
    drain_s: float = 0.0
    drain_end: str = "done"
    storage_ops_cut_off: int = 0
    storage_pages_cut_off: int = 0
    host_pages_cut_off: int = 0
    backups_cut_off: int = 0
    loads_cut_off: int = 0

    def error(self, message: str) -> None:
        """Keep ``message`` (the first ``MAX_ERRORS``; later ones are only counted)."""
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)
        else:
            self.errors_dropped += 1

    def problems(self) -> list[str]:
        """What makes this pass a failure (empty: it passed)."""
        checks = (
            (self.slots_leaked, f"{self.slots_leaked} device slots leaked"),
            (self.rows_leaked, f"{self.rows_leaked} rows leaked"),
            (self.host_pages_leaked, f"{self.host_pages_leaked} host pages leaked"),
            (self.manager_leaked or self.manager_unreleased,
             f"manager: {self.manager_leaked} leaked, {self.manager_unreleased} never released"),
            (self.double_frees, f"{self.double_frees} double frees"),
            (self.lifecycle_errors, f"{self.lifecycle_errors} lifecycle errors"),
            (self.rows_freed != self.rows_admitted, f"rows freed {self.rows_freed} != admitted {self.rows_admitted}"),
            (self.verify_mismatched, f"{self.verify_mismatched} stored pages differ from their KV"),
            (self.pages_refused_corrupt,
             f"{self.pages_refused_corrupt} stored pages refused as corrupt (their bytes or seal changed in "
             "storage; never served)"),
            (self._missing_unexplained(), f"{self._missing_unexplained()} offloaded pages missing from storage "
                                          "(written, not refused, not found)"),
            (self.prefix_mismatches, f"{self.prefix_mismatches} loaded prefix pages differ from their KV"),
            (not self.drained, "copies still in flight after the drain timeout"),
        )
        return [msg for bad, msg in checks if bad]

    def _missing_unexplained(self) -> int:
        """Sampled pages missing with no cause: not refused at the read, no write failed, no copy failed
        or expired (its pages are never stored) and none was cut off by the drain (a cut-off write is
        abandoned, never stored: each of its pages may be missing)."""
        if self.storage_failures or self.verify_unavailable or self.storage_evictions or self.chunks_failed:
            return 0
        return max(0, self.verify_missing - self.verify_refused_corrupt - self.verify_refused_foreign
                   - self.storage_pages_cut_off)

    def missing_causes(self) -> list[str]:
        """Why sampled pages were missing from storage (``verify_missing``), as far as counted."""
        out = []
        if self.verify_refused_corrupt:
            out.append(f"{self.verify_refused_corrupt} refused as corrupt")
        if self.verify_refused_foreign:
            out.append(f"{self.verify_refused_foreign} refused: another page, format or size")
        rest = self.verify_missing - self.verify_refused_corrupt - self.verify_refused_foreign
        if rest > 0:
            why = [w for n, w in ((self.storage_failures, "storage writes failed"),
                                  (self.chunks_failed,
                                   f"{self.chunks_failed} chunks' copies failed or expired (never stored)"),
                                  (self.storage_pages_cut_off,
                                   f"{self.storage_pages_cut_off} pages' writes cut off at the end of the pass"),
                                  (self.storage_evictions, f"the store evicted {self.storage_evictions} pages under its capacity bound"))
                   if n]
            out.append(f"{rest} not found" + (f": {'; '.join(why)}" if why else ""))
        return out

    def unread_reason(self) -> str:
        """Why no sampled page of this pass was read back and compared ("" when some were)."""
        if self.verify_ok or self.verify_mismatched:
            return ""
        if not self.verify_population:
            return "no page was offloaded"
        if not self.verify_sampled:
            return "verification off (--verify none)"
        parts = []
        if self.verify_unavailable:
            parts.append(f"{self.verify_unavailable} sampled pages unreadable: storage down")
        if self.verify_missing:
            parts.append(f"{self.verify_missing} sampled pages missing from storage ({', '.join(self.missing_causes())})")
        return "; ".join(parts)


@dataclass
class Progress:
    """What the progress callback sees (every ~0.1 s)."""

    pass_name: str
    step: int
    done: int
    total: int
    running: int
    waiting: int
    inflight_copies: int
    pages_stored: int


@dataclass
class RunReport:
    """Every pass of a run, the storage backend's counters, and the verdict."""

    config: dict
    passes: list[PassReport]
    storage: dict
    wall_s: float
    shutdown: str = ""      # what the bounded shutdown abandoned ("": nothing); a note, not a failure:
    #                         abandoned copies keep their slots, so nothing is freed under them
    stats: dict | None = None      # lifecycle.node_stats.NodeStats at the end (docs/metrics.md)
    kv_events: dict | None = None  # what --kv-events published (KVEventStats), None without it

    @property
    def problems(self) -> list[str]:
        return [f"{p.name}: {x}" for p in self.passes for x in p.problems()]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def pages_verified(self) -> int:
        """Stored pages read back and found equal to their KV, over every pass."""
        return sum(p.verify_ok for p in self.passes)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "wall_s": round(self.wall_s, 3),
                "config": self.config, "storage": self.storage, "shutdown": self.shutdown,
                "passes": [dataclasses.asdict(p) for p in self.passes], "stats": self.stats,
                "kv_events": self.kv_events}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _verified(p: PassReport) -> str:
    missing = f"missing ({', '.join(p.missing_causes())})"
    extra = [f"{n} {what}" for n, what in ((p.verify_mismatched, "differ"), (p.verify_missing, missing),
                                          (p.verify_unavailable, "unreadable: storage down")) if n]
    return f"{p.verify_ok}/{p.verify_sampled} ok" + (f", {', '.join(extra)}" if extra else "")


ROWS = (
    ("requests (done/aborted/retracted)", lambda p: f"{p.requests} ({p.finished}/{p.aborted}/{p.retracted})"),
    ("readmitted after retraction", lambda p: f"{p.readmitted}"),
    ("decode steps", lambda p: f"{p.steps}"),
    ("tokens decoded", lambda p: f"{p.tokens_decoded}"),
    ("prompt tokens computed (not loaded)", lambda p: f"{p.prompt_tokens_computed}"),
    ("chunks offloaded: landed / failed", lambda p: f"{p.chunks_offloaded}: {p.chunks_landed} / {p.chunks_failed}"),
    ("pages offloaded", lambda p: f"{p.pages_offloaded}"),
    ("bytes offloaded (MiB/s over the pass)", lambda p: f"{_mib(p.bytes_offloaded)} ({p.offload_mib_s:.1f} MiB/s)"),
    ("storage writes of landed chunks (failed)", lambda p: f"{p.storage_ops} ({p.storage_failures})"),
    ("storage pages: newly written / already there", lambda p: f"{p.storage_pages_written} / {p.storage_pages_skipped}"),
    ("  prompt pages backed up (prefill stand-in)",
     lambda p: f"{p.prefill_backup_pages}" + (f" ({p.prefill_backup_failures} failed)" if p.prefill_backup_failures else "")),
    ("host pool short (chunk deferred)", lambda p: f"{p.host_short}"),
    ("prefix pages found / looked up", lambda p: f"{p.prefix_pages_hit}/{p.prefix_pages_looked_up} "
                                                 f"({100 * p.prefix_hit_rate:.1f}%)"),
    ("prefix pages stored, not loaded: host pages/slots short", lambda p: f"{p.prefix_pages_unstaged}"),
    ("prefix lookups missed: tier down, slow or breaker open", lambda p: f"{p.prefix_lookups_failed} of {p.prefix_lookups}"),
    ("bytes loaded from storage", lambda p: _mib(p.prefix_bytes_loaded)),
    ("loaded pages bit-exact / loaded", lambda p: f"{p.prefix_pages_verified - p.prefix_mismatches}/{p.prefix_pages_verified}"),
    ("manager calls per step p50/p99 (1)", lambda p: f"{p.overhead_us_p50:.0f} / {p.overhead_us_p99:.0f} us"),
    ("offloader enqueue per chunk p50/p99 (2)", lambda p: f"{p.enqueue_us_p50:.0f} / {p.enqueue_us_p99:.0f} us"),
    ("slots leaked", lambda p: f"{p.slots_leaked}"),
    ("rows freed / admitted", lambda p: f"{p.rows_freed} / {p.rows_admitted}"),
    ("host pages leaked", lambda p: f"{p.host_pages_leaked}"
                                    + (f" (+{p.host_pages_cut_off} held by cut-off writes)" if p.host_pages_cut_off else "")),
    ("manager leaked / unreleased", lambda p: f"{p.manager_leaked} / {p.manager_unreleased}"),
    ("double frees", lambda p: f"{p.double_frees}"),
    ("lifecycle errors", lambda p: f"{p.lifecycle_errors}"),
    ("stored pages verified: ok / sampled (3)", _verified),
    ("  sampled from pages offloaded", lambda p: f"{p.verify_population}"),
    ("pages refused by storage: corrupt / other page or format (4)",
     lambda p: f"{p.pages_refused_corrupt} / {p.pages_refused_foreign}"),
    ("pages served unverified (no seal) (4)", lambda p: f"{p.pages_served_unverified}"),
    ("end-of-pass wait for copies and storage (5)", lambda p: f"{p.drain_s:.2f} s ({p.drain_end})"),
    ("  cut off: storage writes (pages) / backups / loads",
     lambda p: f"{p.storage_ops_cut_off} ({p.storage_pages_cut_off}) / {p.backups_cut_off} / {p.loads_cut_off}"),
    ("wall time", lambda p: f"{p.wall_s:.2f} s"),
    ("requests per second", lambda p: f"{p.requests_per_s:.1f}"),
)

NOTES = (
    "(1) time inside every DecodeOffloadManager call of a step (check_offload_progress, offload_kv_cache, "
    "finalize_release_on_finish, readmit), the offloader enqueue included",
    "(2) HostOffloader.write on the scheduler thread (gather and hand-off of one chunk; the copy runs on a worker)",
    "(3) pages read back from storage and compared byte for byte with the KV they came from",
    "(4) every read of the pass (prefix loads and verification), as the storage tier counted it",
    "(5) copies are waited for (drain_timeout_s); storage work only while the tier works: once its circuit "
    "breaker is open or nothing finished for drain_stall_s, what is pending is cut off (counted, never stored)",
)


def verdict(report: RunReport) -> list[str]:
    """The last lines: FAILED with every cause; NOT VERIFIED when no stored page was read back and
    compared (nothing went wrong, nothing was shown right); else OK, naming what was checked."""
    if not report.ok:
        return ["FAILED: " + "; ".join(report.problems)]
    lifecycle = "no slot leaked, nothing freed twice"
    unread = [f"{p.name}: {why}" if len(report.passes) > 1 else why
              for p in report.passes if (why := p.unread_reason())]
    if not report.pages_verified:
        return [f"NOT VERIFIED: {lifecycle}; no stored page was read back and compared: " + "; ".join(unread)]
    sampled = sum(p.verify_sampled for p in report.passes)
    line = (f"OK: {lifecycle}, every stored page read back is the KV it came from "
            f"({report.pages_verified} of {sampled} sampled)")
    short = [f"{p.name}: " if len(report.passes) > 1 else "" for p in report.passes]
    gaps = [f"{pre}{n} {what}" for pre, p in zip(short, report.passes)
            if not p.unread_reason()
            for n, what in ((p.verify_unavailable, "unreadable (storage down)"),
                            (p.verify_missing, f"missing ({', '.join(p.missing_causes())})")) if n]
    return [line + ("; not checked: " + ", ".join(gaps + unread) if gaps or unread else "")]


def format_summary(report: RunReport, cfg, prog: str = "kv-lifecycle") -> str:
    """The end-of-run table, one column per pass, then the verdict."""
    passes = report.passes
    rows = [(label, [fn(p) for p in passes]) for label, fn in ROWS]
    lw = max(len(r[0]) for r in rows)
    cw = [max(len(p.name), *(len(r[1][i]) for r in rows)) for i, p in enumerate(passes)]
    head = (f"{prog} simulate: {cfg.requests} requests, {cfg.layers} layers x {cfg.heads} heads x {cfg.head_dim} "
            f"{cfg.torch_dtype_name()}, page {cfg.page_size}, stride {cfg.stride_tokens}, spec {cfg.spec_tokens}, "
            f"storage {cfg.storage_spec}")
    out = [head, "-" * len(head), f"{'':<{lw}}  " + "  ".join(f"{p.name:>{w}}" for p, w in zip(passes, cw))]
    for label, vals in rows:
        out.append(f"{label:<{lw}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, cw)))
    out += NOTES
    if report.shutdown:
        out.append(f"note: {report.shutdown} (storage too slow or down at the end; nothing freed under them)")
    out += verdict(report)
    if not report.ok:
        for p in passes:
            out += [f"  {p.name}: {e}" for e in p.errors[:5]]
    return "\n".join(out)

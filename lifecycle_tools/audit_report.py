"""The human summary of a replayed audit log (``kv-lifecycle audit``)."""

from __future__ import annotations

from collections import Counter

from lifecycle_tools.replay_model import INITIAL_NAME, STATE_NAMES, Replay
from lifecycle_tools.stats import percentile

OUTCOMES = ("stored", "failed", "expired", "landed", "in flight")


def chunk_outcomes(r: Replay) -> Counter:
    """Chunks by outcome (each chunk counted once; the counts add up to ``len(r.chunks)``)."""
    return Counter(c.outcome for c in r.chunks.values())


def format_report(r: Replay, path: str = "", max_violations: int = 50) -> str:
    """Counts, per-state durations, and every violation (capped)."""
    if r.empty:
        return (f"audit log {path}: {r.lines} lines, {r.events} events, no lifecycle events: not a kv-lifecycle "
                "audit log, or the run logged nothing (simulate --audit writes one)"
                + "".join(f"\n  {v}" for v in r.violations[:max_violations]))
    span = (r.t1 - r.t0) * 1000 if r.t0 is not None else 0.0
    outcomes = chunk_outcomes(r)
    split = ", ".join(f"{outcomes[k]} {k}" for k in OUTCOMES if outcomes[k])
    out = [f"audit log {path}: {r.events} events over {span:.1f} ms; {r.requests} requests, "
           f"{len(r.lifecycles)} lifecycles, {len(r.chunks)} chunks offloaded ({split or 'none'})",
           f"{'state':<12}{'entered':>9}{'left':>8}{'p50 ms':>11}{'p99 ms':>11}{'max ms':>11}{'total ms':>12}"]
    for name in STATE_NAMES:
        d = r.durations.get(name, [])
        entered = r.visits[name] + (len(r.lifecycles) if name == INITIAL_NAME else 0)
        out.append(f"{name:<12}{entered:>9}{len(d):>8}{percentile(d, 50) * 1e3:>11.3f}{percentile(d, 99) * 1e3:>11.3f}"
                   f"{max(d, default=0.0) * 1e3:>11.3f}{sum(d) * 1e3:>12.1f}")
    final = Counter(life.state for life in r.lifecycles if not life.readmitted)
    out.append("final states: " + (", ".join(f"{k} {v}" for k, v in sorted(final.items())) or "none"))
    out.append("transitions: " + (", ".join(f"{k} {v}" for k, v in sorted(r.triggers.items(), key=str)) or "none"))
    out.append("(a chunk's 'landed' transition fires when the request's last copy in flight lands, so "
               "transitions 'landed' <= chunks landed)")
    if r.refusals:
        out.append(f"refused calls (the manager said no; not violations): {len(r.refusals)}")
        for line, rid, trig, reason in r.refusals[:5]:
            out.append(f"  line {line}: request {rid!r}: {trig}: {reason}")
    if r.violations:
        out.append(f"VIOLATIONS: {len(r.violations)}")
        out += [f"  {v}" for v in r.violations[:max_violations]]
        if len(r.violations) > max_violations:
            out.append(f"  ... {len(r.violations) - max_violations} more")
    else:
        out.append("OK: every transition legal, every lifecycle released exactly once, never under a copy")
    return "\n".join(out)

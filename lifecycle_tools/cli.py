"""``kv-lifecycle``: simulate a busy decode node, audit its log, draw the lifecycle diagrams.

    kv-lifecycle simulate [--requests N] [--warm] [--audit run.jsonl] [--json report.json] ...
    kv-lifecycle audit run.jsonl [--timeline timeline.svg|timeline.mmd]
    kv-lifecycle diagrams [--out diagrams/]

Exit codes: 0 all good; 1 the run or the log shows a problem (leak, double free, verification
mismatch, lifecycle violation); 2 bad flags or an impossible configuration (one line on stderr,
before any work is done).

This module is application code: it is the one place that configures structlog (the library only
logs). The configuration is made before the manager is built, because a bound logger takes the
configuration at bind time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

PROG = "kv-lifecycle"


class _Parser(argparse.ArgumentParser):
    """Argparse with one-line errors (exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(kind: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if kind == "pos" and v < 1:
            raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
        if kind == "nonneg" and v < 0:
            raise argparse.ArgumentTypeError(f"{v} must not be negative")
        return v
    parse.__name__ = f"{kind} int"
    return parse


def _frac(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must lie in 0..1")
    return v


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{v} must be >= 0 (0: all at once)")
    return v


def build_parser() -> argparse.ArgumentParser:
    from lifecycle_tools.simulate import SimConfig

    d = SimConfig()
    p = _Parser(prog=PROG, description="An explicit, checked lifecycle for a decode node's KV cache.")
    sub = p.add_subparsers(dest="command", metavar="{simulate,audit,diagrams}", parser_class=_Parser)
    sub.required = True

    s = sub.add_parser("simulate", help="run a reference decode scheduler over the real transfer stack",
                       description="Serve a synthetic workload through DecodeOffloadManager and the real "
                                   "transfer stack; check that no slot leaks and that stored pages are exact.")
    pos, nonneg = _int("pos"), _int("nonneg")
    g = s.add_argument_group("model shape")
    g.add_argument("--layers", type=pos, default=d.layers, help=f"layers (default {d.layers})")
    g.add_argument("--heads", type=pos, default=d.heads, help=f"KV heads (default {d.heads})")
    g.add_argument("--head-dim", type=pos, default=d.head_dim, help=f"head dim (default {d.head_dim})")
    g.add_argument("--dtype", default=d.dtype, help=f"KV dtype: bf16, fp16, fp32, fp8 (default {d.dtype})")
    g = s.add_argument_group("pools and offload")
    g.add_argument("--page-size", type=pos, default=d.page_size, help=f"tokens per page (default {d.page_size})")
    g.add_argument("--stride", type=pos, default=None, help="tokens per offload chunk, a page multiple (default: page size)")
    g.add_argument("--device-tokens", type=pos, default=d.device_tokens,
                   help=f"device KV slots (default {d.device_tokens})")
    g.add_argument("--host-tokens", type=pos, default=d.host_tokens, help=f"host pool tokens (default {d.host_tokens})")
    g.add_argument("--rows", type=pos, default=d.rows, help=f"req-to-token rows (default {d.rows})")
    g.add_argument("--max-running", type=pos, default=None, help="decode batch cap (default: rows)")
    g.add_argument("--spec-tokens", type=nonneg, default=d.spec_tokens,
                   help="speculative over-allocation: allocated = committed + N, 1..N+1 accepted per step")
    g.add_argument("--device", default=d.device, help="cpu or cuda (default cpu)")
    g = s.add_argument_group("workload")
    g.add_argument("--requests", type=pos, default=d.requests, help=f"requests in all (default {d.requests})")
    g.add_argument("--turns", type=pos, default=d.turns, help=f"turns per chat; later turns extend earlier ones (default {d.turns})")
    g.add_argument("--system-prompt", type=nonneg, default=d.system_prompt,
                   help=f"tokens of a system prompt every chat shares (default {d.system_prompt})")
    g.add_argument("--prompt-len", default=d.prompt_len,
                   help=f"new prompt tokens per turn: N, LO-HI, exp:MEAN[:MAX], normal:MEAN:STD (default {d.prompt_len})")
    g.add_argument("--output-len", default=d.output_len, help=f"output tokens per request (default {d.output_len})")
    g.add_argument("--arrival-rate", type=_rate, default=d.arrival_rate,
                   help=f"chats arriving per step, Poisson; 0 = all at once (default {d.arrival_rate})")
    g.add_argument("--think-steps", type=nonneg, default=d.think_steps,
                   help=f"steps between a turn's end and the next turn (default {d.think_steps})")
    g.add_argument("--abort-frac", type=_frac, default=d.abort_frac, help=f"fraction aborted mid-decode (default {d.abort_frac})")
    g.add_argument("--retract-frac", type=_frac, default=d.retract_frac,
                   help=f"fraction retracted mid-decode and readmitted (default {d.retract_frac})")
    g.add_argument("--seed", type=nonneg, default=d.seed, help="workload seed; the same seed on the same store hits")
    g = s.add_argument_group("storage, reuse and checks")
    g.add_argument("--store", default="./kv-store", help="file storage directory (default ./kv-store)")
    g.add_argument("--storage", default=None, help="another backend instead: memory, file:DIR, redis://HOST:PORT/DB")
    g.add_argument("--no-reuse", action="store_true", help="never look up stored prefixes")
    g.add_argument("--warm", action="store_true", help="serve the workload a second time: it hits the store")
    g.add_argument("--verify", default=d.verify, help=f"stored pages read back and compared: N, all or none (default {d.verify})")
    g = s.add_argument_group("output")
    g.add_argument("--audit", metavar="PATH", help="write the structured audit log here (JSON lines)")
    g.add_argument("--json", metavar="PATH", help="write the report here as JSON")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")

    a = sub.add_parser("audit", help="replay an audit log and check it against the declared lifecycle",
                       description="Replay a simulate --audit log; exit 1 on any violation.")
    a.add_argument("path", help="the audit log (JSON lines)")
    a.add_argument("--timeline", metavar="OUT", help="draw a per-request timeline: OUT.svg or OUT.mmd (Mermaid)")
    a.add_argument("--max-rows", type=pos, default=100, help="timeline rows drawn (default 100)")

    dg = sub.add_parser("diagrams", help="write the lifecycle state diagrams")
    dg.add_argument("--out", default="diagrams", help="output directory (default diagrams/)")
    dg.add_argument("--states-doc", default="docs/states.md",
                    help="refresh the generated state table in this file when it exists (default docs/states.md)")
    return p


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


# --- logging -------------------------------------------------------------------------------------


def configure_logging(audit_file) -> None:
    """structlog for this process: JSON lines with a monotonic ``t`` (s) into ``audit_file``, or,
    without an audit file, warnings and errors only, to stderr."""
    import structlog

    t0 = time.monotonic()

    def rel_time(_logger, _name, event_dict):
        event_dict["t"] = round(time.monotonic() - t0, 6)
        return event_dict

    if audit_file is not None:
        structlog.configure(
            processors=[structlog.processors.add_log_level,
                        structlog.processors.TimeStamper(fmt="iso", utc=True),
                        rel_time, structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            logger_factory=structlog.WriteLoggerFactory(file=audit_file),
            cache_logger_on_first_use=False,
        )
    else:
        structlog.configure(
            processors=[structlog.processors.add_log_level, rel_time, structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=False,
        )


# --- simulate ------------------------------------------------------------------------------------


class _Bar:
    def __init__(self, stream) -> None:
        self.stream, self.width = stream, 0

    def __call__(self, p) -> None:
        n = 24
        filled = int(n * p.done / p.total) if p.total else n
        line = (f"\r{p.pass_name:>4} [{'#' * filled}{'.' * (n - filled)}] {p.done}/{p.total} done  "
                f"step {p.step}  live {p.running}  waiting {p.waiting}  copies {p.inflight_copies}  "
                f"pages stored {p.pages_stored}")
        self.width = max(self.width, len(line))
        self.stream.write(line.ljust(self.width))
        self.stream.flush()

    def close(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_summary(report, cfg) -> str:
    """The end-of-run table, one column per pass."""
    passes = report.passes
    rows: list[tuple[str, list[str]]] = []

    def row(label, fn):
        rows.append((label, [fn(p) for p in passes]))

    row("requests (done/aborted/retracted)", lambda p: f"{p.requests} ({p.finished}/{p.aborted}/{p.retracted})")
    row("readmitted after retraction", lambda p: f"{p.readmitted}")
    row("decode steps", lambda p: f"{p.steps}")
    row("tokens decoded", lambda p: f"{p.tokens_decoded}")
    row("prompt tokens computed", lambda p: f"{p.prompt_tokens_computed}")
    row("chunks offloaded (landed)", lambda p: f"{p.chunks_offloaded} ({p.chunks_landed})")
    row("pages offloaded", lambda p: f"{p.pages_offloaded}")
    row("bytes offloaded (rate over the run)", lambda p: f"{_mib(p.bytes_offloaded)} ({p.offload_gbps:.3f} GB/s)")
    row("storage ops (failures)", lambda p: f"{p.storage_ops} ({p.storage_failures})")
    row("pages written to storage", lambda p: f"{p.pages_stored} + {p.prefill_backup_pages} prompt")
    row("host pool short", lambda p: f"{p.host_short}")
    row("prefix hit rate (pages)",
        lambda p: f"{p.prefix_pages_hit}/{p.prefix_pages_looked_up} ({100 * p.prefix_hit_rate:.1f}%)")
    row("bytes loaded from storage", lambda p: _mib(p.prefix_bytes_loaded))
    row("loaded pages bit-exact",
        lambda p: f"{p.prefix_pages_verified - p.prefix_mismatches}/{p.prefix_pages_verified}")
    row("manager time per step p50/p99", lambda p: f"{p.overhead_us_p50:.0f} / {p.overhead_us_p99:.0f} us")
    row("slots leaked", lambda p: f"{p.slots_leaked}")
    row("rows freed / admitted", lambda p: f"{p.rows_freed} / {p.rows_admitted}")
    row("host pages leaked", lambda p: f"{p.host_pages_leaked}")
    row("manager leaked / unreleased", lambda p: f"{p.manager_leaked} / {p.manager_unreleased}")
    row("double frees", lambda p: f"{p.double_frees}")
    row("lifecycle errors", lambda p: f"{p.lifecycle_errors}")
    row("stored pages verified", lambda p: (
        f"{p.verify_ok}/{p.verify_sampled} ok of {p.verify_pages_stored}"
        + (f", {p.verify_mismatched} differ" if p.verify_mismatched else "")
        + (f", {p.verify_missing} missing" if p.verify_missing else "")))
    row("wall time", lambda p: f"{p.wall_s:.2f} s")
    lw = max(len(r[0]) for r in rows)
    cw = [max(len(p.name), *(len(r[1][i]) for r in rows)) for i, p in enumerate(passes)]
    stride = cfg.stride or cfg.page_size
    head = (f"{PROG} simulate: {cfg.requests} requests, {cfg.layers} layers x {cfg.heads} heads x {cfg.head_dim} "
            f"{cfg.torch_dtype_name()}, page {cfg.page_size}, stride {stride}, spec {cfg.spec_tokens}, "
            f"storage {cfg.storage}")
    out = [head, "-" * len(head)]
    out.append(f"{'':<{lw}}  " + "  ".join(f"{p.name:>{w}}" for p, w in zip(passes, cw)))
    for label, vals in rows:
        out.append(f"{label:<{lw}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, cw)))
    if report.ok:
        out.append("OK: no slot leaked, nothing freed twice, every stored page checked is the KV it came from")
    else:
        out.append("FAILED: " + "; ".join(report.problems))
        for p in passes:
            for e in p.errors[:5]:
                out.append(f"  {p.name}: {e}")
    return "\n".join(out)


def _check_out_path(path: str, flag: str) -> None:
    from lifecycle_tools.simulate import ConfigProblem

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigProblem(f"{flag} {path!r} is a directory")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigProblem(f"{flag} {path!r}: directory {parent!r} is missing or not writable")


def cmd_simulate(args) -> int:
    from lifecycle_tools.simulate import ConfigProblem, SimConfig, prepare

    storage = args.storage if args.storage else f"file:{args.store}"
    if args.storage and not (args.storage in ("memory",) or args.storage.startswith("file:")
                             or "://" in args.storage):
        storage = f"file:{args.storage}"
    cfg = SimConfig(
        layers=args.layers, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
        page_size=args.page_size, stride=args.stride, device_tokens=args.device_tokens,
        host_tokens=args.host_tokens, rows=args.rows, max_running=args.max_running,
        requests=args.requests, turns=args.turns, system_prompt=args.system_prompt,
        prompt_len=args.prompt_len, output_len=args.output_len, arrival_rate=args.arrival_rate,
        think_steps=args.think_steps, spec_tokens=args.spec_tokens, abort_frac=args.abort_frac,
        retract_frac=args.retract_frac, seed=args.seed, storage=storage, device=args.device,
        reuse=not args.no_reuse, warm=args.warm, verify=args.verify,
    )
    try:
        plans, max_len = prepare(cfg)
        for path, flag in ((args.audit, "--audit"), (args.json, "--json")):
            if path:
                _check_out_path(path, flag)
    except ConfigProblem as err:
        return _fail(str(err))
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return _fail(f"--device {cfg.device}: CUDA is not available")
    audit_file = None
    if args.audit:
        try:
            audit_file = open(args.audit, "w", encoding="utf-8")
        except OSError as err:
            return _fail(f"--audit {args.audit!r}: {err.strerror or err}")
    try:
        configure_logging(audit_file)   # before the manager exists: loggers bind config at bind time
        from lifecycle_tools.simulate import build, run

        try:
            stack, mgr = build(cfg, max_len)
        except ImportError as err:
            return _fail(f"storage {cfg.storage!r} needs a missing package: {err}")
        except Exception as err:  # noqa: BLE001 - storage/pool construction: a config problem
            msg = " ".join(str(err).split()) or type(err).__name__
            return _fail(f"cannot build the stack for storage {cfg.storage!r}: {msg}")
        show = args.progress if args.progress is not None else sys.stderr.isatty()
        bar = _Bar(sys.stderr) if show else None
        try:
            report = run(cfg, stack, mgr, plans, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    finally:
        if audit_file is not None:
            audit_file.flush()
            audit_file.close()
    print(format_summary(report, cfg))
    if args.audit:
        print(f"audit log: {args.audit} (check it: {PROG} audit {args.audit} --timeline timeline.svg)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
            f.write("\n")
    return 0 if report.ok else 1


# --- audit ---------------------------------------------------------------------------------------


def cmd_audit(args) -> int:
    from lifecycle_tools.replay import format_report, replay_file

    if args.timeline and not args.timeline.lower().endswith((".svg", ".mmd", ".mermaid")):
        return _fail(f"--timeline {args.timeline!r} must end in .svg or .mmd")
    try:
        r = replay_file(args.path)
    except OSError as err:
        return _fail(f"cannot read {args.path!r}: {err.strerror or err}")
    except UnicodeDecodeError:
        return _fail(f"{args.path!r} is not a text file")
    print(format_report(r, args.path))
    if args.timeline:
        from lifecycle_tools.timeline import write_timeline

        try:
            out = write_timeline(r, args.timeline, f"kv-lifecycle timeline: {os.path.basename(args.path)}",
                                 args.max_rows)
        except OSError as err:
            return _fail(f"cannot write {args.timeline!r}: {err.strerror or err}")
        print(f"timeline: {out}")
    return 0 if r.ok else 1


# --- diagrams ------------------------------------------------------------------------------------


def cmd_diagrams(args) -> int:
    import shutil
    from pathlib import Path

    from lifecycle_tools.diagrams import refresh_states_doc, write_diagrams

    try:
        paths = write_diagrams(args.out)
        doc = Path(args.states_doc)
        if doc.is_file() and refresh_states_doc(doc):
            paths.append(doc)
    except OSError as err:
        return _fail(f"cannot write diagrams to {args.out!r}: {err.strerror or err}")
    for path in paths:
        print(path)
    if shutil.which("dot") is None:
        sys.stderr.write(f"{PROG}: Graphviz `dot` not found: SVG not rendered (apt-get install graphviz)\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kv-lifecycle`` console script and ``python -m lifecycle_tools``."""
    args = build_parser().parse_args(argv)
    handler = {"simulate": cmd_simulate, "audit": cmd_audit, "diagrams": cmd_diagrams}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

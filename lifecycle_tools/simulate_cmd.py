"""``kv-lifecycle simulate``: flags -> configuration -> stack -> run -> summary (and JSON, audit log)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from lifecycle_tools.command import PROG, fail, out_path_problem


class ProgressBar:
    """A one-line progress bar on ``stream`` (redrawn in place)."""

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


def configure_logging(audit_file) -> None:
    """structlog for this process: JSON lines with a monotonic ``t`` (s) into ``audit_file``, or,
    without an audit file, warnings and errors only, to stderr."""
    import structlog

    t0 = time.monotonic()

    def rel_time(_logger, _name, event_dict):
        event_dict["t"] = round(time.monotonic() - t0, 6)
        return event_dict

    processors = [structlog.processors.add_log_level, rel_time, structlog.processors.JSONRenderer()]
    if audit_file is not None:
        processors.insert(1, structlog.processors.TimeStamper(fmt="iso", utc=True))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG if audit_file else logging.WARNING),
        logger_factory=structlog.WriteLoggerFactory(file=audit_file if audit_file is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )


def _config(args):
    from lifecycle_tools.simulate import OPTIONS, SimConfig

    return SimConfig(**{o.name: getattr(args, o.name) for o in OPTIONS if o.cli is not None})


def _check_outputs(args) -> str | None:
    if args.audit == "-":
        return "--audit - is not supported (the summary goes to stdout); give a file"
    if args.audit and args.json and args.json != "-" and (
            os.path.realpath(args.audit) == os.path.realpath(args.json)):
        return f"--audit and --json both name {args.json!r}; the report would overwrite the audit log"
    for path, flag in ((args.audit, "--audit"), (args.json, "--json")):
        if path and path != "-":
            problem = out_path_problem(path, flag)
            if problem:
                return problem
    return None


def cmd_simulate(args) -> int:
    """Run ``kv-lifecycle simulate``; returns the exit code."""
    from lifecycle_tools.simulate import ConfigProblem, prepare

    cfg = _config(args)
    try:
        width = prepare(cfg)
    except ConfigProblem as err:
        return fail(str(err))
    problem = _check_outputs(args)
    if problem:
        return fail(problem)
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return fail(f"--device {cfg.device}: CUDA is not available")
    audit_file = None
    if args.audit:
        try:
            audit_file = open(args.audit, "w", encoding="utf-8")
        except OSError as err:
            return fail(f"--audit {args.audit!r}: {err.strerror or err}")
    try:
        report, telemetry = _run(cfg, width, args, audit_file)
    except ConfigProblem as err:
        return fail(str(err))
    finally:
        if audit_file is not None:
            audit_file.close()
    args.left_behind = bool(report.shutdown)   # work abandoned at a bounded close: see cli.main
    try:
        rc = _print(report, cfg, args)
        problem = telemetry.push()            # --metrics-push: the final values, once
        if problem:
            rc = fail(problem)
        telemetry.linger()                    # --metrics-linger: /metrics still served
    finally:
        telemetry.close()
    return rc


def _run(cfg, width: int, args, audit_file):
    from lifecycle_tools.interrupt import INTERRUPTS
    from lifecycle_tools.simulate import build, run
    from lifecycle_tools.simulate.calls import EnqueueTimer
    from lifecycle_tools.simulate.runner import shut_down
    from lifecycle_tools.simulate.telemetry import Telemetry

    if audit_file is not None:
        INTERRUPTS.before_exit(audit_file.flush)
    INTERRUPTS.begin_work()         # from here a Ctrl-C stops the run at a safe point (bounded)
    configure_logging(audit_file)   # before the manager exists: loggers bind config at bind time
    timer = EnqueueTimer()
    stack, mgr = build(cfg, width, timer)
    try:
        telemetry = Telemetry.start(cfg, stack, mgr)
    except BaseException:
        shut_down(mgr, stack, 0.0)
        raise
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = ProgressBar(sys.stderr) if show else None
    try:
        report = run(cfg, stack, mgr, progress=bar, enqueue_timer=timer, freeze_gc=True, telemetry=telemetry)
    except BaseException:
        telemetry.close()
        raise
    finally:
        if bar is not None:
            bar.close()
    telemetry.close_events()
    report.kv_events = telemetry.events_stats()
    return report, telemetry   # the metrics server still answers: closed by the caller


def _print(report, cfg, args) -> int:
    from lifecycle_tools.simulate import format_summary

    table = sys.stderr if args.json == "-" else sys.stdout
    print(format_summary(report, cfg, PROG), file=table)
    if args.audit:
        print(f"audit log: {args.audit} (check it: {PROG} audit {args.audit} --timeline timeline.svg)", file=table)
    if args.json == "-":
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report.to_dict(), f, indent=2)
                f.write("\n")
        except OSError as err:
            return fail(f"cannot write --json {args.json!r}: {err.strerror or err}")
    return 0 if report.ok else 1

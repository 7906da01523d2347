"""``kv-lifecycle``: simulate a busy decode node, audit its log, draw the lifecycle diagrams.

    kv-lifecycle simulate [--requests N] [--warm] [--audit run.jsonl] [--json report.json|-] ...
    kv-lifecycle audit run.jsonl [--timeline timeline.svg|timeline.mmd]
    kv-lifecycle diagrams [--out diagrams/] [--states-doc docs/states.md]

Exit codes: 0 all good; 1 the run or the log shows a problem (leak, double free, verification
mismatch, lifecycle violation, a log with no lifecycle events); 2 bad flags, bad input or an
impossible configuration (one line on stderr, before any work is done), or output a finished run
could not deliver (an unwritable ``--json``, a refused ``--metrics-push``: one line after the
summary); 130 interrupted (Ctrl-C).

This module is application code: it is the one place that configures logging (the library only
logs). ``--help`` imports neither torch nor the library.
"""

from __future__ import annotations

import argparse
import os
import sys

from lifecycle_tools.command import PROG, fail, out_path_problem



class _Parser(argparse.ArgumentParser):
    """Argparse with one-line errors (exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def _arg_type(option):
    """An argparse ``type`` from an option's kind: the same check ``validate`` runs."""
    from lifecycle_tools.simulate.errors import ConfigProblem

    def convert(text):
        try:
            return option.kind(text, option.flag)
        except ConfigProblem as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = option.kind.kind
    return convert


def _add_simulate(sub) -> None:
    from lifecycle_tools.simulate.config import OPTIONS

    s = sub.add_parser("simulate", help="run a reference decode scheduler over the real transfer stack",
                       description="Serve a synthetic workload through DecodeOffloadManager and the real "
                                   "transfer stack; check that no slot leaks and that stored pages are exact.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in OPTIONS:
        if o.cli is None:
            continue
        g = groups.get(o.group) or groups.setdefault(o.group, s.add_argument_group(o.group))
        if o.action:
            g.add_argument(o.flag, dest=o.name, action=o.action, help=o.help)
            continue
        shown = "" if o.default is None else f" (default {o.default})"
        g.add_argument(o.flag, dest=o.name, default=o.default, type=_arg_type(o), metavar=o.kind.kind,
                       help=o.help + shown)
    g = s.add_argument_group("output")
    g.add_argument("--audit", metavar="PATH", help="write the structured audit log here (JSON lines)")
    g.add_argument("--json", metavar="PATH", help="write the report here as JSON; - for stdout (the table then "
                                                  "goes to stderr)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (imports no torch)."""
    p = _Parser(prog=PROG, description="An explicit, checked lifecycle for a decode node's KV cache.")
    sub = p.add_subparsers(dest="command", metavar="{simulate,audit,diagrams}", parser_class=_Parser)
    sub.required = True
    _add_simulate(sub)
    a = sub.add_parser("audit", help="replay an audit log and check it against the declared lifecycle",
                       description="Replay a simulate --audit log; exit 1 on any violation or when it "
                                   "holds no lifecycle events.")
    a.add_argument("path", help="the audit log (JSON lines)")
    a.add_argument("--timeline", metavar="OUT", help="draw a per-request timeline: OUT.svg or OUT.mmd (Mermaid)")
    a.add_argument("--max-rows", type=_positive, default=100, help="timeline rows drawn (default 100)")
    dg = sub.add_parser("diagrams", help="write the lifecycle state diagrams",
                        description="Write request_lifecycle.{mmd,dot,svg} into --out; nothing else is written "
                                    "unless --states-doc names a file.")
    dg.add_argument("--out", default="diagrams",
                    help="output directory (default: diagrams/ in the current directory)")
    dg.add_argument("--states-doc", metavar="PATH", default=None,
                    help="also refresh the generated state table in this file (the project's own: "
                         "docs/states.md); without it no other file is touched")
    return p


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= v <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{v} must lie in 1..1000000")
    return v




def cmd_audit(args) -> int:
    from lifecycle_tools.audit_log import LogUnreadable
    from lifecycle_tools.replay import format_report, replay_file

    if args.timeline and not args.timeline.lower().endswith((".svg", ".mmd", ".mermaid")):
        return fail(f"--timeline {args.timeline!r} must end in .svg or .mmd")
    if args.timeline:
        err = out_path_problem(args.timeline, "--timeline")
        if err:
            return fail(err)
    try:
        r = replay_file(args.path)
    except LogUnreadable as err:
        return fail(str(err))
    print(format_report(r, args.path))
    if args.timeline:
        from lifecycle_tools.timeline import write_timeline

        try:
            out = write_timeline(r, args.timeline, f"kv-lifecycle timeline: {os.path.basename(args.path)}",
                                 args.max_rows)
        except OSError as err:
            return fail(f"cannot write {args.timeline!r}: {err.strerror or err}")
        print(f"timeline: {out}")
    return 0 if r.ok else 1


def cmd_diagrams(args) -> int:
    import shutil
    from pathlib import Path

    from lifecycle_tools.diagrams import DocProblem, check_states_doc, refresh_states_doc, write_diagrams

    doc = None if args.states_doc is None else Path(args.states_doc)
    try:
        if doc is not None:
            check_states_doc(doc)      # before anything is written (a missing file: OSError, exit 2)
        paths = write_diagrams(args.out)
        if doc is not None and refresh_states_doc(doc):
            paths.append(doc)
    except DocProblem as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"cannot write diagrams to {args.out!r}: {err.strerror or err}")
    for path in paths:
        print(path)
    if shutil.which("dot") is None:
        sys.stderr.write(f"{PROG}: Graphviz `dot` not found: SVG not rendered (apt-get install graphviz)\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kv-lifecycle`` console script and ``python -m lifecycle_tools``.

    With no ``argv`` the process is the command: ``main`` does not return but ends the process
    (``INTERRUPTS.finish``), so a Ctrl-C at any point from here on exits 130 with one line, never a
    traceback or a death by the signal during the interpreter's finalization. With ``argv`` it
    returns the exit code (130 after Ctrl-C).
    """
    from lifecycle_tools.interrupt import EXIT_INTERRUPTED, INTERRUPTS

    ours = argv is None
    # before any work: parsing and imports take a noticeable fraction of a second, and until the
    # command begins its work (INTERRUPTS.begin_work) a Ctrl-C ends the process at once
    INTERRUPTS.install(at_once=ours)
    args = None
    try:
        args = build_parser().parse_args(argv)
        if args.command == "simulate":
            from lifecycle_tools.simulate_cmd import cmd_simulate as handler
        else:
            handler = {"audit": cmd_audit, "diagrams": cmd_diagrams}[args.command]
        INTERRUPTS.check()
        rc = handler(args)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        if ours:   # the process is ours: exit now, before finalization restores SIGINT's default
            INTERRUPTS.exit_now(quiet=True)
        return EXIT_INTERRUPTED
    except SystemExit as end:   # argparse: --help (0) or a bad flag (2, its line written)
        if not ours:
            raise
        rc = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
        if not isinstance(end.code, (int, type(None))):
            sys.stderr.write(f"{end.code}\n")
    finally:
        if not ours and not INTERRUPTS.requested():   # after Ctrl-C the handler stays: another one exits at once
            INTERRUPTS.uninstall()
    if not ours:
        return rc
    # Storage calls abandoned at a bounded close (a hung or dead tier) may still be running in a
    # client library's native threads; Python's finalization (and an atexit hook of that library)
    # would tear their objects down under them (a C++ client then aborts the process). The result is
    # written: end here, with the run's own exit code, and leave the interpreter's teardown out.
    INTERRUPTS.finish(rc, run_atexit=not getattr(args, "left_behind", False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

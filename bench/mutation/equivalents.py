"""The known-equivalent mutants (``bench/mutation/equivalent.txt``), each tied to the code it was judged on.

mutmut names a mutant after its function and a number (``transfer.page_set.xǁPageSetǁfree__mutmut_4``)
and numbers a function's mutants in the order it makes them: change the function and the same name
may denote another mutant. An equivalent listed by name alone then hides whatever mutant now wears
that name (round five found five such names after one local variable was added). So each line also
records a hash of its function's source at the time the mutant was judged::

    transfer.page_set.xǁPageSetǁfree__mutmut_4  @1a2b3c4d5e6f  # why it is equivalent

An entry is *stale* when its function is gone or its source no longer hashes to the recorded value.
``bench/mutation/campaign.py`` counts a stale entry's survivor as a survivor, not as an equivalent, and lists
it, before its first group and in its report (``stale``: plain ``ast``, mutmut not needed); the
default test suite does not (a refactor of a listed function must not fail the suite). After
re-reading the entry's diff against its reason (``--show``), ``--refresh NAME ...`` records the
current hash; an entry whose mutant no longer fits its reason is deleted or rewritten. (The
numbering is also mutmut's: the ``mutation`` extra pins its version.)

    .venv/bin/python bench/mutation/equivalents.py --check
    .venv/bin/python bench/mutation/equivalents.py --show [NAME ...]     # needs the mutation extra
    .venv/bin/python bench/mutation/equivalents.py --refresh NAME ... | --refresh-all
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT_FILE = ROOT / "bench" / "mutation" / "equivalent.txt"
HASH_CHARS = 12


@dataclass(frozen=True)
class Entry:
    """One line of the list: the mutant, its function's source hash when judged (None: not recorded), why."""

    name: str
    hash: str | None
    reason: str


@dataclass(frozen=True)
class Target:
    """Where a mutant lives: ``module`` (dotted), ``cls`` (None: a module-level function), ``func``."""

    module: str
    cls: str | None
    func: str


def parse_line(line: str) -> Entry | None:
    """``name [@hash] # reason`` (None for a blank line). Raises ValueError on any other shape."""
    head, _, reason = line.partition("#")
    parts = head.split()
    if not parts:
        return None
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].startswith("@")):
        raise ValueError(f"not 'name [@hash] # reason': {line!r}")
    digest = parts[1][1:] if len(parts) == 2 else None
    return Entry(parts[0], digest, reason.strip())


def load(path: Path | None = None) -> list[Entry]:
    """Every entry of the list (default: the repository's), in file order (an absent file: none)."""
    path = EQUIVALENT_FILE if path is None else path
    if not path.exists():
        return []
    return [e for line in path.read_text().splitlines() if (e := parse_line(line)) is not None]


def format_line(entry: Entry) -> str:
    return f"{entry.name}  @{entry.hash}  # {entry.reason}" if entry.hash else f"{entry.name}  # {entry.reason}"


def target(name: str) -> Target:
    """The function a mutant name denotes: ``pkg.mod.x_func__mutmut_3`` or ``pkg.mod.xǁClassǁmethod__mutmut_3``.

    Raises:
        ValueError: not a mutmut mutant name.
    """
    module, _, mutant = name.rpartition(".")
    stem, sep, number = mutant.rpartition("__mutmut_")
    if not module or not sep or not number.isdigit():
        raise ValueError(f"not a mutmut mutant name: {name!r}")
    if stem.startswith("xǁ"):
        cls, _, func = stem[2:].partition("ǁ")
        if not cls or not func:
            raise ValueError(f"not a mutmut method mutant name: {name!r}")
        return Target(module, cls, func)
    if stem.startswith("x_") and len(stem) > 2:
        return Target(module, None, stem[2:])
    raise ValueError(f"not a mutmut mutant name: {name!r}")


def module_file(root: Path, module: str) -> Path | None:
    """The source file of dotted ``module`` under ``root`` (None: there is none)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def function_source(root: Path, t: Target, _cache: dict | None = None) -> str | None:
    """The source lines of ``t`` (decorators included), or None when the module, class or function is gone."""
    path = module_file(root, t.module)
    if path is None:
        return None
    key = str(path)
    if _cache is not None and key in _cache:
        text, tree = _cache[key]
    else:
        text = path.read_text()
        tree = ast.parse(text)
        if _cache is not None:
            _cache[key] = (text, tree)
    body = tree.body
    if t.cls is not None:
        owner = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == t.cls), None)
        if owner is None:
            return None
        body = owner.body
    node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == t.func), None)
    if node is None:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return "\n".join(text.splitlines()[first - 1:node.end_lineno])


def function_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:HASH_CHARS]


def current_hashes(names, root: Path | None = None) -> dict[str, str | None]:
    """Each name's function hash in ``root``'s sources (default: this checkout; None: the function is gone)."""
    root = ROOT if root is None else root
    cache: dict = {}
    out = {}
    for name in names:
        src = function_source(root, target(name), cache)
        out[name] = None if src is None else function_hash(src)
    return out


def stale(entries: list[Entry], root: Path | None = None) -> dict[str, str]:
    """The entries that no longer vouch for their mutant, with why: no hash recorded, function gone,
    or function changed since the entry was judged."""
    now = current_hashes([e.name for e in entries], root)
    out = {}
    for e in entries:
        if e.hash is None:
            out[e.name] = "no function hash recorded"
        elif now[e.name] is None:
            out[e.name] = "its function is gone"
        elif now[e.name] != e.hash:
            out[e.name] = f"its function changed (hash {e.hash} when judged, {now[e.name]} now)"
    return out


def diffs(names: list[str], root: Path | None = None) -> dict[str, str | None]:
    """Each mutant's diff as mutmut generates it from ``root``'s sources (None: mutmut makes no such
    mutant now). Runs mutmut's generator in a child process: mutmut reads its configuration from the
    working directory when imported."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["lifecycle/", "transfer/", "hashing/"]\n')
        proc = subprocess.run([sys.executable, __file__, "--diff-worker", str(ROOT if root is None else root)], cwd=tmp, input=json.dumps(names),
                              capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def _diff_worker(root: Path) -> None:
    import io

    from mutmut.__main__ import write_all_mutants_to_file

    names = json.loads(sys.stdin.read())
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    out: dict[str, str | None] = {}
    for module, wanted in sorted(by_module.items()):
        path = module_file(root, module)
        if path is None:
            out.update(dict.fromkeys(wanted))
            continue
        rel = path.relative_to(root)
        buf = io.StringIO()
        mutated = write_all_mutants_to_file(out=buf, source=path.read_text(), filename=rel)
        lines = buf.getvalue().splitlines()
        spans = mutated.line_span_by_function_name
        for name in wanted:
            mutant = name.rpartition(".")[2]
            orig = mutant.rpartition("__mutmut_")[0] + "__mutmut_orig"
            if mutant not in spans or orig not in spans:
                out[name] = None
                continue
            func = target(name).func

            def text(key, span):
                return [ln.replace(f"def {key}(", f"def {func}(", 1) for ln in lines[span.start - 1:span.end]]

            out[name] = "\n".join(difflib.unified_diff(text(orig, spans[orig]), text(mutant, spans[mutant]),
                                                       str(rel), str(rel), n=2, lineterm=""))
    sys.stdout.write(json.dumps(out))


def rewrite(entries: list[Entry], path: Path | None = None) -> None:
    (EQUIVALENT_FILE if path is None else path).write_text("".join(format_line(e) + "\n" for e in entries))


def main(argv=None, root: Path | None = None, path: Path | None = None) -> int:
    """The command (``root``: the sources, ``path``: the list; default this checkout's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="list stale entries; exit 1 if any")
    group.add_argument("--show", nargs="*", metavar="NAME", help="each entry's reason and its mutant's diff now")
    group.add_argument("--refresh", nargs="+", metavar="NAME", help="record the current hash of these (re-read) entries")
    group.add_argument("--refresh-all", action="store_true", help="record the current hash of every entry")
    group.add_argument("--diff-worker", metavar="ROOT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.diff_worker:
        _diff_worker(Path(args.diff_worker))
        return 0
    entries = load(path)
    if args.check:
        bad = stale(entries, root)
        for name, why in bad.items():
            print(f"{name}: {why}")
        print(f"{len(entries) - len(bad)} of {len(entries)} entries current")
        return 1 if bad else 0
    if args.show is not None:
        chosen = [e for e in entries if not args.show or e.name in args.show]
        got = diffs([e.name for e in chosen], root)
        for e in chosen:
            print(f"### {e.name}\n# {e.reason}\n{got[e.name] or '(mutmut makes no such mutant now)'}\n")
        return 0
    names = {e.name for e in entries} if args.refresh_all else set(args.refresh)
    unknown = names - {e.name for e in entries}
    if unknown:
        print(f"not in the list: {sorted(unknown)}", file=sys.stderr)
        return 2
    now = current_hashes(sorted(names), root)
    gone = sorted(n for n, h in now.items() if h is None)
    if gone:
        print(f"functions gone (delete these entries): {gone}", file=sys.stderr)
        return 2
    rewrite([Entry(e.name, now[e.name], e.reason) if e.name in names else e for e in entries], path)
    print(f"recorded the current hash of {len(names)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())

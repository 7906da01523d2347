"""Tools-side evidence for issue 35: NVIDIA Dynamo's standalone KV indexer consumes a whole
``kv-lifecycle simulate --kv-events`` run with no error logged (one warning: the late join's gap
at sequence 0, which it replays, see below), and matches every prompt the run offloaded exactly as
the file tier holds it.

Not a test (pytest never collects it: it lives under bench/ and is not named ``test_*``) and not a
dependency of the project: Dynamo runs in a scratch virtual environment of its own, as a separate
process, and this script talks to it over HTTP only (stdlib ``urllib``).

Setup (once; Dynamo's PyPI wheel ``ai-dynamo-runtime`` ships the indexer, CPU, x86_64 Linux)::

    python3.11 -m venv /tmp/dynamo-venv
    /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1

Run from the repository root, with the project's own venv::

    .venv/bin/python bench/dynamo_indexer_check.py [--dynamo-python /tmp/dynamo-venv/bin/python]
        [--requests 48] [--keep DIR]

What it does:

1. starts ``python -m dynamo.indexer`` (``DYN_LOG=debug``; its log is captured) and registers one
   worker whose ZMQ endpoint is the run's ``--kv-events`` socket and whose ``replay_endpoint`` is
   the run's ``--kv-events-replay`` socket, block size = the run's page size;
2. runs ``kv-lifecycle simulate`` (the CLI, in a subprocess) with prefill backups, an LRU-bounded
   file tier that evicts, and a warm second pass;
3. waits until Dynamo's tree stops changing (``GET /dump``), then for every request of the
   workload (the same seed gives the same tokens) asks ``POST /query`` with the request's tokens
   and compares Dynamo's ``longest_matched`` with the truth read from the store directory: the
   number of leading pages of the request's page chain present on disk, times the page size;
4. prints one ``RESULT`` line per check and an overall ``PASS``/``FAIL``; exit 0 only on PASS.

A subscriber that joins a running publisher misses what was sent before its subscription reached
the PUB socket (ZMQ's slow joiner; the run publishes within milliseconds of binding): Dynamo logs
one WARN ``Gap detected: expected seq 0, got N`` and replays 0..N from the replay socket, as its
docs describe. That line is reported on its own ``RESULT`` line and passes unless ``--strict``.
``--no-replay`` is the control: registered without the replay socket, the lost start fails the
match (the check can fail).

Checks: simulate exited 0 and sent every batch (``queued/dropped/unsent`` 0); Dynamo logged no
other line at WARN or ERROR (nor any line naming a gap, lost batches or a decode failure, at any
level); the indexer's listener is ``active``; every request's match equals the file tier's (counted:
``matched N/N``; ``offloaded`` is the number of requests with at least one page on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SUSPECT = re.compile(r"gap|lost|fail|decode|truncat|panick|error", re.IGNORECASE)
MODEL = "kv-lifecycle-sim"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"FAIL: timed out waiting for {what}")


def sim_args(a, store: Path, out: Path, ev: str, replay: str) -> list[str]:
    return ["--requests", str(a.requests), "--layers", "1", "--heads", "1", "--head-dim", "8",
            "--page-size", str(a.page_size), "--stride", str(2 * a.page_size), "--system-prompt", "16",
            "--prompt-len", "8-64", "--output-len", "16-64", "--device-tokens", "8192", "--host-tokens", "2048",
            "--rows", "12", "--capacity-bytes", str(a.capacity_bytes), "--warm", "--seed", str(a.seed),
            "--verify", "all", "--no-progress", "--store", str(store), "--json", str(out),
            "--kv-events", ev, "--kv-events-replay", replay]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dynamo-python", default="/tmp/dynamo-venv/bin/python")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--capacity-bytes", type=int, default=40000)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--strict", action="store_true", help="fail on the late-join gap at sequence 0 too")
    p.add_argument("--no-replay", action="store_true",
                   help="control: register without the replay socket (the late join's batches stay lost)")
    p.add_argument("--keep", help="keep the store, report and Dynamo's log in this directory")
    a = p.parse_args()

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="dynamo-check-"))
    work.mkdir(parents=True, exist_ok=True)
    store, out, log_path = work / "store", work / "report.json", work / "dynamo.log"
    port = free_port()
    ev, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DYN_LOG": "debug", "NO_COLOR": "1"}
    results: list[tuple[bool, str]] = []
    with open(log_path, "w") as log:
        dyn = subprocess.Popen([a.dynamo_python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(lambda: http(f"{base}/workers") == [], 60, "Dynamo's indexer to listen")
            reg = {"instance_id": 1, "endpoint": ev, "model_name": MODEL, "block_size": a.page_size}
            http(f"{base}/register", reg if a.no_replay else {**reg, "replay_endpoint": replay})
            wait_for(lambda: http(f"{base}/workers")[0]["status"] == "active", 60, "the listener")
            t0 = time.monotonic()
            sim = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate",
                                  *sim_args(a, store, out, ev, replay)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=600)
            wall = time.monotonic() - t0
            results.append((sim.returncode == 0, f"simulate exit {sim.returncode} in {wall:.1f} s"))
            if sim.returncode != 0:
                print(sim.stdout[-3000:], sim.stderr[-3000:], file=sys.stderr)
                return finish(results, log_path, a.strict)
            sent = json.loads(out.read_text())["kv_events"]
            results.append(((sent["queued"], sent["dropped"], sent["unsent"]) == (0, 0, 0),
                            f"simulate sent {sent['batches']} batches, queued/dropped/unsent "
                            f"{sent['queued']}/{sent['dropped']}/{sent['unsent']}"))

            def dump_size() -> int:
                return sum(len(v["events"]) for v in http(f"{base}/dump").values())

            last, stable_since = -1, time.monotonic()
            while time.monotonic() - stable_since < 2.0:          # the tree stopped changing for 2 s
                n = dump_size()
                if n != last:
                    last, stable_since = n, time.monotonic()
                time.sleep(0.2)
            results.append((True, f"Dynamo's tree dump: {last} events (stable for 2 s)"))
            status = http(f"{base}/workers")[0]
            results.append((status["status"] == "active", f"listener status {status['status']}"
                            + (f" last_error {status['listeners']['0'].get('last_error')}"
                               if status["listeners"]["0"].get("last_error") else "")))
            results.append(compare(a, base, store))
        finally:
            dyn.terminate()
            try:
                dyn.wait(10)
            except subprocess.TimeoutExpired:
                dyn.kill()
                dyn.wait()
    rc = finish(results, log_path, a.strict)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return rc


def compare(a, base: str, store: Path) -> tuple[bool, str]:
    sys.path.insert(0, str(ROOT))
    import hashing
    from lifecycle_tools.simulate import SimConfig, all_plans, make_workload, prepare

    cfg = SimConfig(requests=a.requests, system_prompt=16, prompt_len="8-64", output_len="16-64",
                    page_size=a.page_size, stride=2 * a.page_size, seed=a.seed, layers=1, heads=1, head_dim=8,
                    device_tokens=8192, host_tokens=2048, rows=12, storage=f"file:{store}")
    prepare(cfg)
    on_disk = {n[:64] for n in os.listdir(store) if n.endswith(".bin") and not n.startswith(".")}
    matched = offloaded = total = 0
    wrong: list[str] = []
    for plan in all_plans(make_workload(cfg)):
        seed = hashing.namespace_seed(plan.extra_key, plan.cache_salt)
        tokens = [*plan.prompt, *plan.output]
        chain = hashing.page_hashes(tokens, a.page_size, seed)
        lead = next((i for i, h in enumerate(chain) if h not in on_disk), len(chain))
        got = http(f"{base}/query", {"token_ids": tokens, "model_name": MODEL})
        inst = got.get("instances", {}).get("1", {})
        dyn_tokens = inst.get("longest_matched", 0)
        total += 1
        offloaded += lead > 0
        if dyn_tokens == lead * a.page_size:
            matched += 1
        else:
            wrong.append(f"{plan.rid}: store {lead} pages, Dynamo {dyn_tokens} tokens ({inst})")
    for w in wrong[:10]:
        print("  mismatch", w)
    return (not wrong, f"Dynamo's /query equals the file tier for {matched}/{total} requests "
                       f"({offloaded} with pages on disk; {len(on_disk)} pages on disk)")


def finish(results: list[tuple[bool, str]], log_path: Path, strict: bool = False) -> int:
    """Judge Dynamo's log. A subscriber that joins a running publisher misses the batches sent
    before its subscription reached the PUB socket (ZMQ's slow joiner): Dynamo logs one WARN
    ``Gap detected: expected seq 0, got N``, asks the replay socket for 0..N and logs ``Replay
    complete``. That one is reported on its own line (a FAIL only with ``--strict``); any other WARN
    or ERROR line, any line naming a loss or failure, or a start gap not replayed in full fails."""
    lines = [ANSI.sub("", ln.rstrip("\n")) for ln in open(log_path, errors="replace")]
    bad = [ln for ln in lines if re.search(r"\b(WARN|ERROR)\b", ln)]
    replays = [int(m.group(1)) for m in (re.search(r"Replay complete.*replayed=(\d+)", ln) for ln in lines) if m]
    start_gap: list[int] = []
    for ln in list(bad):
        m = re.search(r"Gap detected: expected seq 0, got (\d+)", ln)
        if m and not start_gap and any(r >= int(m.group(1)) for r in replays):
            start_gap.append(int(m.group(1)))
            bad.remove(ln)
    suspect = [ln for ln in lines if SUSPECT.search(ln.split("  ", 1)[-1]) and ln not in bad
               and "Gap detected: expected seq 0" not in ln]
    if start_gap:
        results.append((not strict, f"Dynamo joined late: WARN 'Gap detected: expected seq 0, got {start_gap[0]}', "
                                    f"then 'Replay complete replayed={max(replays)}' from the replay socket"))
    results.append((not bad, f"Dynamo log: {len(lines)} lines, {len(bad)} other at WARN/ERROR"))
    results.append((not suspect, f"Dynamo log: {len(suspect)} other lines naming a gap/loss/failure"))
    for ln in (bad + suspect)[:20]:
        print("  log:", ln)
    for ok, text in results:
        print(f"RESULT {'ok  ' if ok else 'FAIL'} {text}")
    passed = all(ok for ok, _ in results)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1

if __name__ == "__main__":
    sys.exit(main())

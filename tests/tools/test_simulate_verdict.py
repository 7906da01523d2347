"""Issue 21: the verdict says what it checked. Pages refused as corrupt have a row and a FAILED line
naming corruption; a run whose verification read nothing never prints OK, and says why. (A storage
tier killed mid-run: tests/tools/test_simulate_outage.py.)"""

import json
import os
import subprocess
import sys

RUN = ["--requests", "20", "--prompt-len", "16-48", "--output-len", "16-40", "--layers", "1", "--heads", "1",
       "--head-dim", "8", "--page-size", "4", "--device-tokens", "2048", "--host-tokens", "512", "--rows", "6",
       "--seed", "7", "--no-progress"]


def simulate(tmp_path, *flags, name="r"):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", *RUN, *flags, "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(out.read_text())


def row(stdout, label):
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(label)]
    return line[len(label):].strip()


def flip_a_bit(path):
    """Change one byte of a page file in place (its seal, an extended attribute, stays)."""
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x10]))


def test_bit_flipped_pages_have_a_row_and_the_failed_line_names_corruption(tmp_path):
    store = tmp_path / "store"
    proc, _ = simulate(tmp_path, "--store", str(store), name="first")
    assert proc.returncode == 0, proc.stdout
    pages = sorted(store.iterdir())
    flipped = pages[::4]
    for path in flipped:
        flip_a_bit(path)
    # the same workload again over the same store, every page offloaded read back
    proc, report = simulate(tmp_path, "--store", str(store), "--verify", "all", name="second")
    assert proc.returncode == 1, proc.stdout
    (p,) = report["passes"]
    assert p["pages_refused_corrupt"] > 0 and p["verify_mismatched"] == 0   # refused, never served
    assert p["pages_refused_corrupt"] == report["storage"]["corrupt"] <= len(flipped)
    assert row(proc.stdout, "pages refused by storage: corrupt / other page or format (4)") == \
        f"{p['pages_refused_corrupt']} / 0"
    verdict = proc.stdout.strip().splitlines()[-1] if not p["errors"] else \
        [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED:")][0]
    assert verdict.startswith("FAILED:") and "refused as corrupt" in verdict, verdict
    if p["verify_missing"]:   # sampled pages refused at the read back: the cause is on their row too
        assert "refused as corrupt" in row(proc.stdout, "stored pages verified: ok / sampled (3)")


def test_a_run_that_read_nothing_back_says_so_and_never_ok(tmp_path):
    proc, report = simulate(tmp_path, "--store", str(tmp_path / "s"), "--verify", "none")
    assert proc.returncode == 0, proc.stdout       # nothing went wrong (exit codes as documented)
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("NOT VERIFIED:") and "--verify none" in verdict and "OK" not in verdict, verdict
    assert report["ok"] is True and report["passes"][0]["verify_ok"] == 0


def test_ok_names_what_was_checked(tmp_path):
    proc, report = simulate(tmp_path, "--store", str(tmp_path / "s"), "--verify", "8")
    assert proc.returncode == 0, proc.stdout
    (p,) = report["passes"]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("OK:") and f"({p['verify_ok']} of {p['verify_sampled']} sampled)" in verdict
    assert p["verify_ok"] == p["verify_sampled"] == 8


def test_pages_without_a_seal_are_counted_as_served_unverified(tmp_path):
    store = tmp_path / "store"
    proc, _ = simulate(tmp_path, "--store", str(store), name="first")
    assert proc.returncode == 0, proc.stdout
    stripped = 0
    for path in store.iterdir():   # as `cp -r` or SGLang's HiCacheFile would leave them: no seal
        os.removexattr(path, "user.kv_lifecycle.checksum")
        stripped += 1
    proc, report = simulate(tmp_path, "--store", str(store), "--verify", "all", name="second")
    assert proc.returncode == 0, proc.stdout
    (p,) = report["passes"]
    assert 0 < p["pages_served_unverified"] == report["storage"]["unverified"]
    assert row(proc.stdout, "pages served unverified (no seal) (4)") == str(p["pages_served_unverified"])

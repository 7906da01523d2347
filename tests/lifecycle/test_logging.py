"""The library is quiet by default and its audit trail complete when asked (issue 12).

Run in a fresh interpreter: the test session configures structlog (tests/conftest.py), an
embedding server does not.
"""

import subprocess
import sys
import textwrap

EMBED = textwrap.dedent(
    """
    import logging, sys
    from lifecycle import DecodeOffloadManager
    from lifecycle_tools.testkit.doubles import PagedAllocator, Req, ReqToTokenPool
    from lifecycle_tools.testkit.memory import InMemoryOffloader

    pool, alloc = ReqToTokenPool(), PagedAllocator(page_size=4)
    off = InMemoryOffloader(page_size=4, host_pages=64)
    mgr = DecodeOffloadManager(pool, alloc, page_size=4, offloader=off)

    def run(rid, row):
        req = Req(rid, range(8), row=row)
        for t in range(9):
            req.decode(t)
            mgr.offload_kv_cache(req)
        off.land(); mgr.check_offload_progress()
        req.finish()
        if not mgr.offload_kv_cache(req):
            mgr.finalize_release_on_finish(req)
        off.land(); mgr.check_offload_progress(); off.complete_storage(); mgr.check_offload_progress()

    run("quiet", 0)
    print("---", flush=True)
    if sys.argv[1] == "debug":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
        run("loud", 1)
    """
)


def _run(mode):
    return subprocess.run([sys.executable, "-c", EMBED, mode], capture_output=True, text=True, timeout=120)


def test_an_unconfigured_host_prints_nothing():
    out = _run("quiet")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "---\n" and out.stderr == ""


def test_logging_configured_after_construction_takes_effect():
    out = _run("debug")
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split("---\n")
    assert before == ""
    lines = after.splitlines()
    assert any(line.startswith("lifecycle lifecycle.transition") and "rid='loud'" in line for line in lines), after
    assert any("lifecycle.chunk_enqueued" in line for line in lines)
    assert any("lifecycle.released" in line for line in lines)
    assert "quiet" not in after

"""Retention from a one-line spec (issue 21): ``ttl_s``, ``key_prefix`` and ``capacity_bytes`` as
query options of ``open_storage``'s spec, parsed here (``transfer.storage.retention``), applied by
the real tiers: a real redis-server's keys carry the prefix and expire, a file store stays under
its byte bound."""

import subprocess
import sys

import pytest
import redis
import torch

from transfer import open_storage
from transfer.errors import StorageConfigError
from transfer.storage.retention import split_retention_options, with_retention_options

NB = 256
KEYS = [f"{i:064x}" for i in range(1, 9)]


def pages(n):
    return [torch.full((NB,), i, dtype=torch.uint8) for i in range(n)]


@pytest.mark.parametrize("spec, rest, options", [
    ("redis://h:6379/0?ttl_s=3600&key_prefix=kv%3A&db=0", "redis://h:6379/0?db=0",
     dict(ttl_s=3600.0, key_prefix="kv:")),
    ("redis+cluster://h:7000?capacity_bytes=4096", "redis+cluster://h:7000", dict(capacity_bytes=4096)),
    ("file:/data/kv?capacity_bytes=1000000", "file:/data/kv", dict(capacity_bytes=1_000_000)),
    ("memory?capacity_bytes=512", "memory", dict(capacity_bytes=512)),
    ("mooncake://h:50051?replica_num=2", "mooncake://h:50051?replica_num=2", {}),
    ("file:/data/kv", "file:/data/kv", {}),
    ("file:/data/what?", "file:/data/what?", {}),            # a "?" without options is the name's
    ("file:/data/a?b?capacity_bytes=9", "file:/data/a?b", dict(capacity_bytes=9)),
    ("redis://h:6379/0", "redis://h:6379/0", {}),
])
def test_options_are_split_from_the_spec(spec, rest, options):
    assert split_retention_options(spec) == (rest, options)


@pytest.mark.parametrize("spec, words", [
    ("redis://h:6379/0?ttl_s=an-hour", "not a number of seconds"),
    ("redis://h:6379/0?ttl_s=inf", "finite"),
    ("redis://h:6379/0?capacity_bytes=1.5", r"capacity_bytes='1\.5' is not a whole number of bytes \(in"),
    ("redis://h:6379/0?ttl_s=1&ttl_s=2", "given twice"),
    ("file:/data/kv?ttl_s=60", "has no option 'ttl_s'"),
    ("file:/data/kv?max_size=60", "unknown file storage option"),
    ("memory?key_prefix=x", "has no option 'key_prefix'"),
    ("mooncake://h:50051?capacity_bytes=1", "global_segment_size"),
    ("mooncake://h:50051?ttl_s=1", "do not expire"),
])
def test_a_bad_option_is_one_typed_error_before_anything_opens(spec, words, tmp_path):
    with pytest.raises(StorageConfigError, match=words):
        split_retention_options(spec)
    with pytest.raises(StorageConfigError, match=words):
        open_storage(spec.replace("/data/kv", str(tmp_path / "never")), "", NB)
    assert not (tmp_path / "never").exists()       # nothing was created


def test_the_spec_and_an_argument_disagreeing_is_an_error():
    with pytest.raises(StorageConfigError, match="give one"):
        open_storage("memory?capacity_bytes=512", "", NB, capacity_bytes=1024)
    open_storage("memory?capacity_bytes=512", "", NB, capacity_bytes=512).close()   # the same: fine


def test_with_retention_options_appends_what_was_given():
    assert with_retention_options("redis://h:1/0", ttl_s=60, key_prefix=None) == "redis://h:1/0?ttl_s=60"
    assert with_retention_options("redis://h:1/0?db=0", key_prefix="a:") == "redis://h:1/0?db=0&key_prefix=a%3A"
    assert with_retention_options("file:/d", capacity_bytes=9) == "file:/d?capacity_bytes=9"
    assert with_retention_options("file:/d") == "file:/d"
    with pytest.raises(StorageConfigError, match="given twice"):
        with_retention_options("redis://h:1/0?ttl_s=5", ttl_s=6)


def test_with_retention_options_on_file_and_memory_specs_follows_their_last_question_mark():
    # a "?" in a directory name is part of the name: the options go after a "?" of their own
    assert with_retention_options("file:/data/a?b", capacity_bytes=9) == "file:/data/a?b?capacity_bytes=9"
    assert split_retention_options("file:/data/a?b?capacity_bytes=9") == ("file:/data/a?b", dict(capacity_bytes=9))
    assert with_retention_options("memory?x", capacity_bytes=9) == "memory?x?capacity_bytes=9"
    # options already in the spec: the new one joins them, so giving one twice is caught
    with pytest.raises(StorageConfigError, match="given twice"):
        with_retention_options("file:/d?capacity_bytes=9", capacity_bytes=10)
    with pytest.raises(StorageConfigError, match="given twice"):
        with_retention_options("memory?capacity_bytes=9", capacity_bytes=10)


def test_redis_keys_carry_the_prefix_and_expire(redis_url):
    store = open_storage(redis_url + "?ttl_s=600&key_prefix=team-a%3A", "_m_0_1", NB)
    try:
        assert store.batch_set(KEYS[:3], pages(3)) == [True] * 3
        assert store.batch_exists(KEYS[:3]) == 3
    finally:
        store.close()
    client = redis.Redis.from_url(redis_url)
    names = sorted(k.decode() for k in client.keys("*"))
    assert names == sorted(f"team-a:{k}_m_0_1" for k in KEYS[:3])
    assert all(0 < client.ttl(n) <= 600 for n in names)
    client.close()


def test_file_store_byte_bound_from_the_spec(tmp_path):
    store = open_storage(f"file:{tmp_path}?capacity_bytes={3 * NB}", "_m_0_1", NB)
    try:
        assert store.batch_set(KEYS, pages(len(KEYS))) == [True] * len(KEYS)
        st = store.stats()
        assert st.pages == 3 and st.bytes <= 3 * NB and st.evictions == len(KEYS) - 3
    finally:
        store.close()
    assert len(list(tmp_path.glob("*.bin"))) == 3


def test_simulate_flags_set_ttl_and_prefix_on_a_real_redis(redis_url, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle_tools", "simulate", "--requests", "6", "--layers", "1", "--heads", "1",
         "--head-dim", "8", "--no-progress", "--storage", redis_url, "--ttl", "900", "--key-prefix", "sim:"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = redis.Redis.from_url(redis_url)
    names = client.keys("*")
    assert names and all(n.startswith(b"sim:") and 0 < client.ttl(n) <= 900 for n in names)
    client.close()


def test_simulate_refuses_an_option_the_tier_does_not_have(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", "--store", str(tmp_path / "s"),
                           "--ttl", "60"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "has no option 'ttl_s'" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "s").exists()

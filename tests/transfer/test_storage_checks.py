"""``transfer/storage/checks.py``: every storage input checked in one place, before anything is
written, in every tier (memory, file, a real Redis, a real Redis Cluster, a real Mooncake master).

Written from the promise (docs/storage.md, ``Storage.batch_set``): a bad input is a typed error
raised before anything is written — a page whose bytes a tier cannot round-trip (complex,
quantized, sub-byte dtypes, conjugate/negative views, autograd tensors), a TTL out of range, a
declared page format whose size is not ``page_nbytes``, a size that is not positive.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import time
import warnings

import pytest
import torch

from lifecycle_tools.testkit.mooncake_server import mooncake_master, mooncake_session_master  # noqa: F401
from lifecycle_tools.testkit.redis_cluster import redis_cluster  # noqa: F401 (fixture)
from transfer import FileStorage, MemoryStorage, TransferError, open_storage
from transfer.errors import InvalidPage, PageSizeMismatch, StorageConfigError, StorageError
from transfer.storage.checks import BYTE_EXACT_DTYPES, MAX_TTL_S, check_ttl
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.integrity import PageFormat

NB = 64
SUFFIX = "_m_0_1"
IDENT = DeploymentIdentity(model_name="m")  # every tier is named for it; its file suffix is SUFFIX
TIERS = ["memory", "file", "redis", "cluster", "mooncake"]
_n = itertools.count()


def fresh(n: int) -> list[str]:
    return [hashlib.sha256(f"checks-{time.time_ns()}-{next(_n)}".encode()).hexdigest() for _ in range(n)]


def all_dtypes() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    return sorted(found, key=str)


def page_of(dtype: torch.dtype) -> torch.Tensor:
    """A page of ``NB`` bytes of ``dtype`` (quantized dtypes through ``quantize_per_tensor``)."""
    name = str(dtype).removeprefix("torch.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in ("qint8", "quint8", "qint32"):
            return torch.quantize_per_tensor(torch.zeros(NB // dtype.itemsize), 0.1, 0, dtype)
        if name in ("quint4x2", "quint2x4"):
            return torch.quantize_per_tensor(torch.zeros(NB), 0.1, 0, dtype)
        return torch.zeros(NB // dtype.itemsize, dtype=dtype)


def good(i: int = 1) -> torch.Tensor:
    return torch.full((NB,), i, dtype=torch.uint8)


@pytest.fixture(params=TIERS)
def tier(request, tmp_path):
    """``spec`` of a fresh store of this tier (its server started by the test kit)."""
    if request.param == "memory":
        return "memory"
    if request.param == "file":
        return f"file:{tmp_path / 'store'}"
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url
    return request.getfixturevalue("mooncake_master").spec()


@pytest.fixture
def store(tier):
    s = open_storage(tier, SUFFIX, identity=IDENT, page_nbytes=NB)
    yield s
    s.close()


def test_byte_exact_dtypes_round_trip_and_every_other_dtype_is_refused_by_name_before_any_write(store):
    for dtype in all_dtypes():
        keys = fresh(2)
        try:
            bad = page_of(dtype)
        except (RuntimeError, TypeError):  # a dtype torch cannot even allocate a page of
            continue
        if dtype in BYTE_EXACT_DTYPES:
            page = bad.view(torch.uint8).copy_(torch.arange(NB, dtype=torch.uint8)).view(dtype)
            assert store.batch_set(keys[:1], [page]) == [True], dtype
            out = torch.zeros_like(page)
            assert store.batch_get(keys[:1], [out]) == [True], dtype
            assert torch.equal(out.view(torch.uint8), page.view(torch.uint8)), dtype
            continue
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(InvalidPage, match=name):  # second in the batch: the first is not written either
            store.batch_set(keys, [good(), bad])
        with pytest.raises(InvalidPage, match=name):
            store.batch_get(keys, [good(), bad])
        assert store.batch_exists(keys[:1]) == 0, dtype
    assert store.stats().errors == 0


def test_views_a_tier_cannot_copy_are_refused_before_any_write(store):
    f = torch.arange(NB // 4, dtype=torch.float32)
    refused = {
        "conjugate": torch.zeros(NB // 8, dtype=torch.complex64).conj(),
        "negative": torch._neg_view(f),
        "requires grad": f.clone().requires_grad_(),
        "sparse": torch.zeros(NB // 4).to_sparse(),
        "not a tensor": bytearray(NB),
        "non-contiguous": torch.zeros(NB * 2, dtype=torch.uint8)[::2],
        "meta": torch.empty(NB, dtype=torch.uint8, device="meta"),
    }
    for what, bad in refused.items():
        keys = fresh(2)
        with pytest.raises(InvalidPage) as err:
            store.batch_set(keys, [good(), bad])
        assert isinstance(err.value, TransferError) and isinstance(err.value, ValueError), what
        assert store.batch_exists(keys[:1]) == 0, what
    with pytest.raises(PageSizeMismatch):
        store.batch_set(fresh(2), [good(), torch.zeros(NB + 2, dtype=torch.uint8)])
    with pytest.raises(InvalidPage):
        store.batch_set(fresh(2), [good()])


@pytest.mark.parametrize("ttl", [math.inf, -math.inf, math.nan, 1e300, 10**400, MAX_TTL_S * 2, -1, 0, 1e-9,
                                 "5", True, [5]])
def test_a_ttl_out_of_range_is_refused_by_every_tier_before_opening(tier, ttl, tmp_path):
    with pytest.raises(StorageConfigError, match="ttl_s"):
        open_storage(tier, SUFFIX, identity=IDENT, page_nbytes=NB, ttl_s=ttl)
    assert not os.path.exists(tmp_path / "store")


def test_ttl_bounds_are_whole_milliseconds():
    assert check_ttl(None) is None and check_ttl(0.001) == 1 and check_ttl(2.5) == 2500
    assert check_ttl(MAX_TTL_S) == round(MAX_TTL_S * 1000)


def test_redis_keeps_a_valid_ttl(redis_url):
    import redis

    s = open_storage(redis_url, SUFFIX, identity=IDENT, page_nbytes=NB, ttl_s=3600)
    try:
        key = fresh(1)
        assert s.batch_set(key, [good()]) == [True]
        ttl_ms = redis.Redis.from_url(redis_url).pttl(key[0] + SUFFIX)
        assert 3_500_000 < ttl_ms <= 3_600_000
    finally:
        s.close()


@pytest.mark.parametrize("fmt,why", [
    (PageFormat.of("page_first", torch.bfloat16, (2, 4, 1, 1, 8)), "is 128 bytes"),  # twice page_nbytes
    (PageFormat.of("raw", torch.uint8, (NB - 1,)), "is 63 bytes"),
    (PageFormat("raw", "complex64", (NB // 8,)), "complex"),
    (PageFormat("raw", "qint8", (NB,)), "quantized"),
    (PageFormat("raw", "bogus", (NB,)), "not a torch dtype"),
])
def test_a_page_format_that_is_not_page_nbytes_of_a_byte_exact_dtype_is_refused_by_every_tier(tier, fmt, why,
                                                                                             tmp_path):
    with pytest.raises(StorageConfigError, match=why):
        open_storage(tier, SUFFIX, identity=IDENT, page_nbytes=NB, page_format=fmt)
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("nbytes", [0, -5, True, 1.5, "64"])
def test_a_page_size_that_is_not_a_positive_int_is_refused_by_every_tier(tier, nbytes, tmp_path):
    with pytest.raises(StorageConfigError, match="page_nbytes"):
        open_storage(tier, SUFFIX, identity=IDENT, page_nbytes=nbytes)
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("kw", [dict(page_nbytes=0), dict(page_nbytes=-5), dict(capacity_bytes=0),
                                dict(capacity_pages=-1), dict(write_threads=0), dict(write_threads=None),
                                dict(stale_temp_s=math.nan), dict(stale_temp_s=-1)])
def test_file_store_sizes_are_refused_before_the_directory_is_made(tmp_path, kw):
    (what,) = kw  # the error begins with the argument at fault (write_threads may not be None)
    with pytest.raises(StorageConfigError, match=f"^{what} must be"):
        FileStorage(tmp_path / "store", SUFFIX, **{"page_nbytes": NB, **kw})
    assert not os.path.exists(tmp_path / "store")


def test_memory_store_sizes_are_typed_errors():
    for kw in (dict(page_nbytes=0), dict(capacity_bytes=-1), dict(capacity_pages=0)):
        with pytest.raises(StorageConfigError):
            MemoryStorage(SUFFIX, **{"page_nbytes": NB, **kw})


def test_redis_sizes_and_timeouts_are_refused_before_connecting():
    from transfer.storage.redis.store import RedisStorage

    url = "redis://127.0.0.1:1/0"  # nothing listens: a refusal must come before any connection
    for kw in (dict(pipeline_bytes=0), dict(capacity_pages=0), dict(connect_timeout_s=math.nan),
               dict(socket_timeout_s=-1), dict(connect_timeout_s=math.inf)):
        with pytest.raises(StorageConfigError):
            RedisStorage(url, SUFFIX, NB, **kw)


def test_an_odd_mha_page_size_is_refused_by_mooncake(mooncake_master):
    with pytest.raises(StorageConfigError, match="halves"):
        open_storage(mooncake_master.spec(), SUFFIX, identity=IDENT, page_nbytes=NB + 1)
    with pytest.raises(StorageError):
        open_storage(mooncake_master.spec(), SUFFIX, identity=IDENT, page_nbytes=0)


def test_a_capacity_that_is_not_a_positive_int_is_refused_by_every_tier(tier, tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(StorageConfigError, match="capacity_bytes"):
            open_storage(tier, SUFFIX, identity=IDENT, page_nbytes=NB, capacity_bytes=bad)
    assert not os.path.exists(tmp_path / "store")

"""The store the integration opens from SGLang's configuration: HiCacheFile's directory and names,
MLA written by TP rank 0 only (as SGLang's ``backup_skip``), the byte cap."""

from __future__ import annotations

import os

import pytest
import torch

from lifecycle.integrations.sglang import SGLangConfigError, read_config
from lifecycle.integrations.sglang.storage import ReplicaStorage, open_storage
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from transfer.errors import PageSizeMismatch
from transfer.host_pool import HostPool
from transfer.storage.base import StorageStats

HASH = "ab" * 32


def _host(mla: bool) -> HostPool:
    return HostPool(2, 1 if mla else 2, 8, torch.bfloat16, 4, 16, mla=mla)


def _config(tmp_path, **ctx):
    return read_config(runtime_context(page_size=4, model="org/M", **ctx),
                       {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)})


def _page(host: HostPool, value: int) -> torch.Tensor:
    page = host.page_view(0)
    page.fill_(value)
    return page


@pytest.mark.parametrize("mla,tp,pp,name", [
    (False, (1, 2), (0, 1), f"{HASH}_org-M_1_2.bin"),
    (True, (0, 2), (0, 1), f"{HASH}_org-M.bin"),
    (False, (0, 1), (1, 2), f"{HASH}_org-M_0_1_2_1.bin"),
])
def test_pages_get_hicache_file_names(tmp_path, mla, tp, pp, name):
    host = _host(mla)
    store = open_storage(_config(tmp_path, pp_rank=pp[0], pp_size=pp[1]), host, tp[0], tp[1], mla)
    assert store.batch_set([HASH], [_page(host, 3)]) == [True]
    store.close()
    assert os.listdir(tmp_path) == [name]
    with open(tmp_path / name, "rb") as f:
        assert f.read() == _page(host, 3).contiguous().view(torch.uint8).numpy().tobytes()


def test_mla_pages_are_written_by_tp_rank_0_only(tmp_path):
    host = _host(True)
    replica = open_storage(_config(tmp_path), host, 1, 2, True)
    assert isinstance(replica, ReplicaStorage)
    assert replica.batch_set([HASH], [_page(host, 5)]) == [True]
    assert os.listdir(tmp_path) == [] and replica.stats().skipped == 1
    owner = open_storage(_config(tmp_path), host, 0, 2, True)
    assert owner.batch_set([HASH], [_page(host, 5)]) == [True]
    assert replica.batch_exists([HASH]) == 1  # reads see the owner's pages
    into = torch.zeros_like(host.page_view(1))
    assert replica.batch_get([HASH], [into]) == [True] and bool((into == 5).all())
    assert replica.delete(HASH) is False and os.listdir(tmp_path) == [f"{HASH}_org-M.bin"]
    with pytest.raises(ValueError):
        replica.batch_set([HASH, HASH], [_page(host, 5)])  # checked like any store's batch
    owner.close()
    replica.close()


def test_an_unwritable_directory_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    cfg = read_config(runtime_context(page_size=4),
                      {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(blocker / "sub")})
    with pytest.raises(SGLangConfigError, match="SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        open_storage(cfg, _host(False), 0, 1, False)


class CountingReader:
    """A reader store whose own stats already count skipped pages."""

    suffix, page_nbytes = "_s", 64

    def stats(self):
        return StorageStats(skipped=3, hits=1)


def test_a_replica_adds_every_skipped_write_to_its_readers_stats():
    replica = ReplicaStorage(CountingReader())
    page = torch.zeros(64, dtype=torch.uint8)
    assert replica.batch_set([HASH, "cd" * 32], [page, page]) == [True, True]
    assert replica.batch_set(["ef" * 32], [page]) == [True]
    stats = replica.stats()
    assert (stats.skipped, stats.hits) == (3 + 3, 1)
    with pytest.raises(PageSizeMismatch):
        replica.batch_set([HASH], [torch.zeros(32, dtype=torch.uint8)])

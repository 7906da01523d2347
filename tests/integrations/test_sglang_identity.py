"""The drop-in's deployment identity from SGLang's configuration, as SGLang 0.5.19's decode
offload manager builds its storage config; pages stored in the host layout SGLang resolved, so an
SGLang node of that layout reads them right (HiCacheFile semantics, host pools verbatim)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lifecycle.integrations.sglang import SGLangConfigError, read_config
from lifecycle.integrations.sglang.identity import deployment_identity
from lifecycle.integrations.sglang.storage import open_storage
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from tests.data.sglang_0_5_19 import HiCacheFileNames, storage_config_from_controller
from tests.support.sglang_pages import random_host, same_kv, sglang_pool

HASH = "ab" * 32


def _config(tmp_path, layout: str = "page_first", **ctx):
    config = read_config(runtime_context(page_size=4, model="org/M", **ctx),
                         {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)})
    return dataclasses.replace(config, mem_layout=layout)  # as SGLang's hicache hook resolved it


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("pp", [(0, 1), (1, 2)])
def test_identity_is_sglangs_decode_offload_storage_config(tmp_path, mla, pp):
    config = _config(tmp_path, pp_rank=pp[0], pp_size=pp[1])
    ident = deployment_identity(config, 1, 2, mla)
    # DecodeKVCacheOffloadManager passes no attention-CP group: SGLang's config says CP 0 of 1
    sglang = storage_config_from_controller(tp_rank=1, tp_size=2, pp_rank=pp[0], pp_size=pp[1],
                                            attn_cp_group_rank_size=(0, 1), is_mla=mla, layout="page_first",
                                            model_name="org/M", extra_config={})
    assert ident.file_name(HASH) == HiCacheFileNames(sglang).file_name(HASH)
    assert (ident.attn_cp_rank, ident.attn_cp_size, ident.layout, ident.mla) == (0, 1, "page_first", mla)


def test_the_backend_tag_comes_from_the_extra_config_as_sglang_reads_it(tmp_path):
    config = dataclasses.replace(_config(tmp_path), extra_config={"extra_backend_tag": 42})
    assert deployment_identity(config, 0, 1, False).backend_tag == "42"  # str(), as MooncakeStore does


def test_a_layout_sglang_has_no_form_for_is_refused_in_one_line(tmp_path):
    with pytest.raises(SGLangConfigError) as err:
        deployment_identity(_config(tmp_path, "page_head"), 0, 1, True)
    assert "MLA" in str(err.value) and "\n" not in str(err.value)


def test_sglangs_split_heads_naming_is_refused_in_one_line(tmp_path):
    config = dataclasses.replace(_config(tmp_path, "page_head"), extra_config={"tp_lcm_size": 4})
    with pytest.raises(SGLangConfigError) as err:
        deployment_identity(config, 0, 2, False)
    assert "tp_lcm_size" in str(err.value) and "\n" not in str(err.value)
    assert deployment_identity(config, 0, 4, False).tp_size == 4  # tp_lcm_size == tp_size: no split


@pytest.mark.parametrize("mla,layout", [(False, "page_first_direct"), (False, "page_head"), (True, "page_first_direct")])
def test_an_sglang_node_of_the_resolved_layout_reads_the_drop_ins_pages_right(tmp_path, mla, layout):
    host = random_host(2, 2, 24 if mla else 8, 4, 4, mla)
    store = open_storage(_config(tmp_path, layout), host, 0, 1, mla)
    try:
        assert store.batch_set([HASH], [host.page_bytes(2)]) == [True]
        name = deployment_identity(_config(tmp_path, layout), 0, 1, mla).file_name(HASH)
        pool = sglang_pool(host, layout, pages=2)
        with open(tmp_path / name, "rb") as f:  # HiCacheFile.get, then set_from_flat_data_page
            pool.set_from_flat_data_page(4, torch.frombuffer(bytearray(f.read()), dtype=host.buffer.dtype))
        assert same_kv(host, 2, pool, 1)
        into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
        assert store.batch_get([HASH], [into]) == [True] and torch.equal(into, host.page_bytes(2))
    finally:
        store.close()
    # a page_first node of the same deployment never serves that page
    first = open_storage(_config(tmp_path), host, 0, 1, mla)
    try:
        into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
        assert first.batch_get([HASH], [into]) == [False] and first.stats().foreign == 1
    finally:
        first.close()

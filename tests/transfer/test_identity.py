"""The deployment identity: every name is a function of it, equal to SGLang 0.5.19's own naming
(copied verbatim into ``tests/data/sglang_0_5_19.py``) for every combination of TP x PP x
attention-CP x MLA x backend tag; deployments SGLang cannot name or lay out are refused in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.data.sglang_0_5_19 import HiCacheFileNames, MooncakeStoreNames, storage_config_from_controller
from tests.support.sglang_pages import fill_random, random_host, same_kv, sglang_pool
from transfer import build_stack
from transfer.errors import StorageConfigError
from transfer.storage.identity import LAYOUTS, DeploymentIdentity, identity_changes
from transfer.storage.mooncake.keys import MooncakeNaming

HASHES = ["ab" * 32, "0123456789abcdef" * 4]
TP = [(0, 1), (1, 2), (3, 4)]
PP = [(0, 1), (0, 2), (1, 2), (2, 4)]
CP = [(0, 1), (0, 2), (1, 2)]
TAGS = [None, "tenant-a", 7]  # SGLang's extra config is JSON: a tag may be a number (it applies str())
MODELS = ["", "org/Llama-3.1-8B", "a/b/c"]


def _pairs():
    return itertools.product(TP, PP, CP, MODELS)


def _config(tp, pp, cp, model, mla, tag):
    extra = {} if tag is None else {"extra_backend_tag": tag}
    return storage_config_from_controller(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
                                          attn_cp_group_rank_size=cp, is_mla=mla, layout="page_first",
                                          model_name=model, extra_config=extra)


def _identity(tp, pp, cp, model, mla, tag):
    return DeploymentIdentity(model_name=model, backend_tag=None if tag is None else str(tag), tp_rank=tp[0],
                              tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=cp[0],
                              attn_cp_size=cp[1], mla=mla)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tag", TAGS)
def test_file_names_are_hicache_files_for_every_combination(mla, tag):
    for tp, pp, cp, model in _pairs():
        ident = _identity(tp, pp, cp, model, mla, tag)
        sglang = HiCacheFileNames(_config(tp, pp, cp, model, mla, tag))
        for h in HASHES:
            assert ident.file_name(h) == sglang.file_name(h), (tp, pp, cp, model)
        assert ident.file_suffix == sglang.config_suffix


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tag", TAGS)
def test_mooncake_objects_are_mooncake_stores_for_every_combination(mla, tag):
    for tp, pp, cp, model in _pairs():
        naming = MooncakeNaming.of(_identity(tp, pp, cp, model, mla, tag))
        sglang = MooncakeStoreNames(_config(tp, pp, cp, model, mla, tag))
        for h in HASHES:
            assert naming.objects(h) == sglang.set_keys([h]) == sglang.exists_keys([h]), (tp, pp, cp, model)
            assert naming.seal_object(h) not in sglang.set_keys([h]) and naming.seal_object(h).endswith("_kvlp")


def test_the_pipeline_and_context_parallel_names_the_issue_names():
    """PP and CP names, spelled out (what parsing the suffix string back used to get wrong)."""
    h = HASHES[0]
    pp = DeploymentIdentity(model_name="org/m", tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)
    assert MooncakeNaming.of(pp).objects(h) == [f"org-m_{h}_0_1_k", f"org-m_{h}_0_1_v"]
    assert pp.file_name(h) == f"{h}_org-m_0_1_2_1.bin"
    assert MooncakeNaming.of(pp.replace(mla=True)).objects(h) == [f"org-m_{h}_1_k"]
    cp = DeploymentIdentity(model_name="org/m", attn_cp_rank=1, attn_cp_size=2)
    assert MooncakeNaming.of(cp).objects(h) == [f"org-m_{h}_0_k", f"org-m_{h}_0_v"]  # SGLang leaves CP out
    assert cp.file_name(h) == f"{h}_org-m_0_1_cp1_2.bin"  # HiCacheFile keeps it


def test_context_parallel_ranks_share_object_names_but_not_the_sealed_name():
    h = HASHES[0]
    zero, one = (MooncakeNaming.of(DeploymentIdentity(model_name="m", attn_cp_rank=r, attn_cp_size=2)) for r in (0, 1))
    assert zero.objects(h) == one.objects(h) and zero.seal_object(h) == one.seal_object(h)
    assert zero.page_name(h) != one.page_name(h)  # so one CP rank never verifies another's page


def test_redis_keys_are_a_function_of_the_identity():
    h = HASHES[0]
    ident = DeploymentIdentity(model_name="org/m", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert ident.redis_key(h) == f"{h}_org-m_1_2_2_1"
    assert ident.replace(backend_tag="t").redis_key(h) == f"t_{h}_org-m_1_2_2_1"


@pytest.mark.parametrize("fields,words", [
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"pp_rank": 0, "pp_size": 0}, "pp_rank"),
    ({"attn_cp_rank": -1, "attn_cp_size": 2}, "attn_cp_rank"),
    ({"tp_rank": True}, "tp_rank"),
    ({"tp_rank": 1.0, "tp_size": 2}, "tp_rank"),
    ({"model_name": "a b"}, "model_name"),
    ({"model_name": "a\nb"}, "model_name"),
    ({"model_name": None}, "model_name"),
    ({"backend_tag": ""}, "backend_tag"),
    ({"backend_tag": "x\ty"}, "backend_tag"),
    ({"layout": "layer_first"}, "layer_first"),
    ({"layout": "page_first_kv_split"}, "page_first_kv_split"),
    ({"mla": True, "layout": "page_head"}, "MLA"),
    ({"mla": 1}, "mla"),
    ({"model_name": "x" * 200}, "too long"),
    ({"model_name": "../up"}, "suffix"),
])
def test_a_deployment_sglang_cannot_name_or_lay_out_is_refused_in_one_line(fields, words):
    with pytest.raises(StorageConfigError) as err:
        DeploymentIdentity(**fields)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_every_layout_sglang_writes_is_accepted():
    for layout in LAYOUTS:
        assert DeploymentIdentity(layout=layout).layout == layout
    assert DeploymentIdentity(mla=True, layout="page_first_direct").mla


def test_url_options_become_identity_fields():
    assert identity_changes({"model": "org/m", "tp_rank": "1", "mla": "yes", "layout": "page_head"}) == {
        "model_name": "org/m", "tp_rank": 1, "mla": True, "layout": "page_head"}
    for bad in ({"tp_rank": "x"}, {"mla": "maybe"}):
        with pytest.raises(StorageConfigError):
            identity_changes(bad)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("pp,cp", [((1, 2), (0, 1)), ((0, 1), (1, 2)), ((1, 2), (1, 2))], ids=["pp2", "cp2", "pp2cp2"])
def test_pp_and_cp_stacks_share_pages_both_ways_with_hicache_file(tmp_path, mla, pp, cp):
    """A stack's file tier and SGLang's HiCacheFile (names from its config suffix, bytes from its
    host pool's get_data_page / set_from_flat_data_page) read each other's pages."""
    width = 24 if mla else 8
    stack = build_stack(2, 1 if mla else 2, width, torch.bfloat16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}",
                        mla=mla, model_name="org/m", tp_rank=1, tp_size=2, pp_rank=pp[0], pp_size=pp[1],
                        attn_cp_rank=cp[0], attn_cp_size=cp[1])
    try:
        host = stack.host_pool
        host.buffer.copy_(random_host(2, 2, width, 4, 4, mla).buffer)
        sglang = HiCacheFileNames(_config((1, 2), pp, cp, "org/m", mla, None), str(tmp_path))
        pool = sglang_pool(host, "page_first", pages=2)
        mine, theirs = HASHES
        assert stack.storage.batch_set([mine], [host.page_bytes(0)]) == [True]
        with open(tmp_path / sglang.file_name(mine), "rb") as f:  # HiCacheFile.get
            pool.set_from_flat_data_page(4, torch.frombuffer(bytearray(f.read()), dtype=torch.bfloat16))
        assert same_kv(host, 0, pool, 1)
        fill_random(pool, seed=5)
        with open(tmp_path / sglang.file_name(theirs), "wb") as f:  # HiCacheFile.set
            f.write(pool.get_data_page(0, flat=True).contiguous().view(torch.uint8).numpy().tobytes())
        assert stack.storage.batch_exists([theirs]) == 1
        assert stack.storage.batch_get([theirs], [host.page_bytes(1)]) == [True] and same_kv(host, 1, pool, 0)
    finally:
        stack.close()


@pytest.mark.parametrize("fields, what", [
    ({"model_name": "a\x01b"}, "model_name"),  # a control character that is not whitespace
    ({"model_name": "a\x7fb"}, "model_name"),  # DEL
    ({"backend_tag": "a\x7fb"}, "backend_tag"),
])
def test_a_control_character_is_refused_naming_the_field(fields, what):
    with pytest.raises(StorageConfigError, match=rf"\b{what} must be a str without whitespace or control characters"):
        DeploymentIdentity(**fields)


def test_refusals_name_the_field_and_what_is_supported():
    with pytest.raises(StorageConfigError) as err:
        DeploymentIdentity(backend_tag="")
    assert str(err.value).startswith("deployment identity: backend_tag") and "must be None or a non-empty" in str(err.value)
    with pytest.raises(StorageConfigError) as err:
        DeploymentIdentity(layout="layer_first")
    assert str(err.value).rsplit("supported: ", 1)[1].split(", ") == list(LAYOUTS)
    with pytest.raises(StorageConfigError) as err:
        DeploymentIdentity(mla=True, layout="page_head")
    assert str(err.value).rsplit("supported for MLA: ", 1)[1].split(", ") == ["page_first", "page_first_direct"]

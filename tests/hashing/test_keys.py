import pytest

from hashing import storage_key, storage_suffix


def test_mha_suffix_has_tp_rank_and_size():
    assert storage_suffix("meta-llama/Llama-3-8B", 1, 4) == "_meta-llama-Llama-3-8B_1_4"


def test_mla_suffix_drops_tp():
    assert storage_suffix("deepseek-ai/DeepSeek-V3", 3, 8, is_mla=True) == "_deepseek-ai-DeepSeek-V3"


def test_pipeline_parallel_suffix():
    assert storage_suffix("m", 0, 2, pp_rank=1, pp_size=4) == "_m_0_2_4_1"
    assert storage_suffix("m", 0, 2, is_mla=True, pp_rank=1, pp_size=4) == "_m_4_1"


def test_key_is_hash_plus_suffix():
    assert storage_key("ab" * 32, "_m_0_1") == "ab" * 32 + "_m_0_1"


@pytest.mark.parametrize("args", [("m", 2, 2), ("m", -1, 1), ("m", 0, 0), ("m", 0.0, 1), ("m", True, 2)])
def test_bad_ranks_rejected(args):
    with pytest.raises(ValueError):
        storage_suffix(*args)


@pytest.mark.parametrize("kw", [{"attn_cp_rank": 2, "attn_cp_size": 2}, {"attn_cp_size": 0},
                                {"attn_cp_rank": -1, "attn_cp_size": 2}])
def test_bad_context_parallel_ranks_rejected(kw):
    with pytest.raises(ValueError):
        storage_suffix("m", 0, 1, **kw)


def sglang_config_suffix(model_name, tp_rank, tp_size, pp_rank, pp_size, is_mla, attn_cp_rank, attn_cp_size):
    """SGLang 0.5.19 ``HiCacheFile.__init__`` (sglang/srt/mem_cache/hicache_storage.py), verbatim."""
    model_name = "-".join(model_name.split("/")) if model_name else ""
    enable_pp = pp_size > 1
    config_suffix = f"_{model_name}"
    if not is_mla:
        config_suffix += f"_{tp_rank}_{tp_size}"
    if enable_pp:
        config_suffix += f"_{pp_size}_{pp_rank}"
    if attn_cp_size > 1:
        config_suffix += f"_cp{attn_cp_rank}_{attn_cp_size}"
    return config_suffix


@pytest.mark.parametrize("model", ["", None, "m", "org/Llama-3.1-8B", "a/b/c"])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tp,pp,cp", [((0, 1), (0, 1), (0, 1)), ((1, 4), (0, 1), (1, 2)), ((3, 8), (1, 2), (0, 1)),
                                      ((0, 2), (3, 4), (2, 4))])
def test_suffix_is_sglang_config_suffix(model, mla, tp, pp, cp):
    ours = storage_suffix(model, tp[0], tp[1], is_mla=mla, pp_rank=pp[0], pp_size=pp[1],
                          attn_cp_rank=cp[0], attn_cp_size=cp[1])
    assert ours == sglang_config_suffix(model, tp[0], tp[1], pp[0], pp[1], mla, cp[0], cp[1])


def test_empty_model_name_is_sglangs_unnamed_suffix():
    assert storage_suffix("", 0, 1) == "__0_1"
    assert storage_suffix("m", 1, 2, attn_cp_rank=1, attn_cp_size=2) == "_m_1_2_cp1_2"


def test_empty_prior_hash_is_no_prior():
    # SGLang's get_hash_str: ``bytes.fromhex(prior_hash) if prior_hash else None``
    from hashing import page_hashes

    assert page_hashes(list(range(8)), 4, "") == page_hashes(list(range(8)), 4, None)

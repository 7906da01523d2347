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


@pytest.mark.parametrize("args", [("", 0, 1), ("m", 2, 2), ("m", -1, 1), ("m", 0, 0)])
def test_bad_ranks_rejected(args):
    with pytest.raises(ValueError):
        storage_suffix(*args)

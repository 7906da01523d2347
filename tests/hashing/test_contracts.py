"""The edges of hashing's documented contracts (each one a mutant that survived the older suite).

Expected names come from a second implementation (sha256 over the raw prior digest and the
tokens as uint32 little-endian), never from the code under test.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from hashing import TokenRangeError, hash_page, namespace_seed, page_hashes, storage_suffix

PRIOR = "5c" * 32


def spec_page(tokens, prior_hex=None):
    prior = bytes.fromhex(prior_hex) if prior_hex else b""
    return hashlib.sha256(prior + struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


def test_hash_page_chains_from_its_prior():
    assert hash_page([1, 2, 3, 4], PRIOR) == spec_page([1, 2, 3, 4], PRIOR)
    assert hash_page([1, 2, 3, 4], PRIOR) != hash_page([1, 2, 3, 4])


def test_extreme_token_ids_are_valid_and_hashed_as_u32():
    tokens = [0, 0xFFFFFFFF, 0, 0xFFFFFFFF]
    assert page_hashes(tokens, 4) == [spec_page(tokens)]


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_the_first_bad_token_is_named_even_after_extreme_valid_ones(bad):
    with pytest.raises(TokenRangeError, match="position 2"):
        page_hashes([0, 0xFFFFFFFF, bad, 4], 4)


@pytest.mark.parametrize("prior", ["ab" * 31, "ab" * 33, "ab" * 31 + "a"])
def test_prior_of_the_wrong_length_is_refused(prior):
    with pytest.raises(ValueError, match="64"):
        page_hashes([1, 2, 3, 4], 4, prior)
    with pytest.raises(ValueError, match="64"):
        hash_page([1, 2, 3, 4], prior)


def test_prior_is_checked_even_when_there_is_no_full_page():
    with pytest.raises(ValueError, match="prior hash"):
        page_hashes([1, 2], 4, "not hex")
    with pytest.raises(ValueError, match="prior hash"):
        page_hashes([], 1, "ab" * 31)


@pytest.mark.parametrize("size", [True, 1.0, "4", -4])
def test_page_size_must_be_a_positive_int_not_a_bool(size):
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2, 3, 4], size)


def test_namespace_type_error_names_the_type():
    with pytest.raises(TypeError, match="str or None, got int"):
        namespace_seed("a", 3)


def test_storage_suffix_defaults_are_rank_0_of_1():
    assert storage_suffix("m") == "_m_0_1"


def test_two_stage_pipeline_is_in_the_suffix():
    assert storage_suffix("m", pp_rank=1, pp_size=2) == "_m_0_1_2_1"


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((3,), {}, "model_name must be a str"),
        (("m", 2, 2), {}, r"tp_rank 2 is not in 0\.\.tp_size-1 \(size 2\)"),
        (("m",), {"pp_rank": 3, "pp_size": 2}, r"pp_rank 3 is not in 0\.\.pp_size-1 \(size 2\)"),
        (("m",), {"attn_cp_rank": 2, "attn_cp_size": 2},
         r"attn_cp_rank 2 is not in 0\.\.attn_cp_size-1 \(size 2\)"),
    ],
)
def test_bad_suffix_arguments_are_named(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        storage_suffix(*args, **kwargs)


@pytest.mark.parametrize("kwargs", [{"tp_size": True}, {"pp_size": True}, {"attn_cp_size": True},
                                    {"tp_rank": False}, {"tp_size": 2.0}])
def test_bool_or_float_ranks_and_sizes_are_refused(kwargs):
    with pytest.raises(ValueError, match="rank"):
        storage_suffix("m", **kwargs)

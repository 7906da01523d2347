import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hashing import TokenRangeError, extend_chain, hash_page, namespace_seed, page_hashes

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "hash-vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["chains"], ids=lambda c: f"{len(c['tokens'])}tok-p{c['page_size']}")
def test_reference_chains(case):
    assert page_hashes(case["tokens"], case["page_size"], case["prior_hash"]) == case["page_hashes"]


@pytest.mark.parametrize("case", VECTORS["namespace_seeds"], ids=lambda c: f"{c['extra_key']}-{c['cache_salt']}")
def test_reference_namespace_seeds(case):
    assert namespace_seed(case["extra_key"], case["cache_salt"]) == case["seed"]


def test_reference_seeded_chain():
    case = VECTORS["seeded_chain"]
    assert page_hashes(case["tokens"], case["page_size"], case["prior_hash"]) == case["page_hashes"]


def test_trailing_partial_page_is_not_hashed():
    assert page_hashes([1, 2, 3], 4) == []
    assert len(page_hashes(list(range(11)), 4)) == 2


def test_single_page_matches_hash_page():
    assert page_hashes([1, 2, 3, 4], 4) == [hash_page([1, 2, 3, 4])]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 9), st.integers(0, 80))
def test_extend_equals_whole_chain(tokens, page_size, cut):
    cut = min(cut, len(tokens)) // page_size * page_size
    head, tail = extend_chain(None, tokens[:cut], page_size)
    rest, end = extend_chain(tail, tokens[cut:], page_size)
    whole = page_hashes(tokens, page_size)
    assert head + rest == whole
    assert end == (whole[-1] if whole else None)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_out_of_range_token_raises_naming_position(bad):
    with pytest.raises(TokenRangeError, match="position 2"):
        page_hashes([1, 2, bad, 4], 4)


def test_bad_page_size_and_prior():
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)
    with pytest.raises(ValueError, match="prior hash"):
        page_hashes([1], 1, "abc")
    with pytest.raises(ValueError, match="not hex"):
        page_hashes([1], 1, "z" * 64)


def test_namespace_none_when_both_absent_and_types_checked():
    assert namespace_seed() is None
    with pytest.raises(TypeError):
        namespace_seed(3, None)


@pytest.mark.parametrize("case", VECTORS["chains"], ids=lambda c: f"{len(c['tokens'])}tok-p{c['page_size']}")
def test_packed_array_and_other_sequences_give_the_reference_chain(case):
    from array import array

    want = case["page_hashes"]
    tokens, ps, prior = case["tokens"], case["page_size"], case["prior_hash"]
    assert page_hashes(array("I", tokens), ps, prior) == want  # pre-packed: hashed as is
    assert page_hashes(tuple(tokens), ps, prior) == want
    assert page_hashes(array("q", tokens), ps, prior) == want  # other typecodes are repacked


def test_partial_tail_is_not_packed_or_checked_and_input_is_not_changed():
    from array import array

    tokens = [1, 2, 3, 4, -1]  # the bad token lies in the trailing partial page: never named
    assert page_hashes(tokens, 4) == [hash_page([1, 2, 3, 4])]
    packed = array("I", range(10))
    page_hashes(packed, 4)
    assert packed == array("I", range(10)) and tokens == [1, 2, 3, 4, -1]


@pytest.mark.parametrize("bad", ["i", "q"])
def test_signed_array_with_a_negative_token_raises_naming_position(bad):
    from array import array

    with pytest.raises(TokenRangeError, match="position 1"):
        page_hashes(array(bad, [5, -3, 7, 8]), 2)

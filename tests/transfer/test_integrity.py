"""The page seal: keys, suffixes, formats, and what verify refuses (structured corruptions fuzzed)."""

import os
import random

import numpy as np
import pytest
import torch

from transfer.errors import InvalidKey, StorageConfigError, TransferError
from transfer.storage.integrity import (
    SEAL_NBYTES, PageFormat, Verdict, check_key, check_suffix, decode_seal, raw_format, seal, verify,
    written_by_another,
)

KEY = "ab" * 32
NAME = KEY + "_m_0_1"
BF16 = PageFormat.of("page_first", torch.bfloat16, (2, 4, 2, 2, 64))  # 4 KiB


def corruptions(page: bytes, rng: random.Random):
    """Structured corruptions of a page (each a different byte string of the same length)."""
    n = len(page)
    words = np.frombuffer(page, dtype="<u8").copy()
    out = []
    for k in (2, 3, 4, 8):  # multi-bit flips anywhere
        b = bytearray(page)
        for bit in rng.sample(range(n * 8), k):
            b[bit // 8] ^= 1 << (bit % 8)
        out.append(("flips%d" % k, bytes(b)))
    b = bytearray(page)  # two sign bits (bit 63 of two words; two fp16/bf16 sign bits)
    i, j = rng.sample(range(n // 8), 2)
    b[i * 8 + 7] ^= 0x80
    b[j * 8 + 7] ^= 0x80
    out.append(("two_sign_bits", bytes(b)))
    w = words.copy()  # compensating word changes: +d in one word, -d in another
    d = np.uint64(rng.randrange(1, 1 << 40))
    w[i] += d
    w[j] -= d
    out.append(("compensating", w.tobytes()))
    w = words.copy()  # swapped words
    w[i], w[j] = words[j], words[i]
    if w.tobytes() != page:
        out.append(("swapped", w.tobytes()))
    start = rng.randrange(0, n - 64)  # zeroed block
    b = bytearray(page)
    b[start:start + 64] = bytes(64)
    if bytes(b) != page:
        out.append(("zeroed", bytes(b)))
    return out


def test_structured_corruptions_never_verify():
    rng = random.Random(7)
    for trial in range(200):
        page = os.urandom(4096)
        s = seal(NAME, BF16, page)
        assert len(s) == SEAL_NBYTES and verify(s, NAME, BF16, page) is Verdict.OK
        for what, bad in corruptions(page, rng):
            assert verify(s, NAME, BF16, bad) is Verdict.CORRUPT, (trial, what)


def test_renamed_and_foreign_format_pages_are_refused():
    page = os.urandom(4096)
    s = seal(NAME, BF16, page)
    assert verify(s, "cd" * 32 + "_m_0_1", BF16, page) is Verdict.FOREIGN  # renamed onto another key
    assert verify(s, KEY + "_m_1_2", BF16, page) is Verdict.FOREIGN  # another rank's page
    fp16 = PageFormat.of("page_first", torch.float16, BF16.shape)  # same size, another dtype
    layer_first = PageFormat.of("layer_first", torch.bfloat16, BF16.shape)
    transposed = PageFormat.of("page_first", torch.bfloat16, (2, 4, 2, 64, 2))
    for fmt in (fp16, layer_first, transposed):
        assert verify(s, NAME, fmt, page) is Verdict.FOREIGN
    assert verify(s, NAME, BF16, page + b"\0") is Verdict.WRONG_SIZE
    for junk in (b"", b"not a seal", bytes(SEAL_NBYTES), s[:-1]):
        assert verify(junk, NAME, BF16, page) is Verdict.CORRUPT
    assert decode_seal(s).format == BF16


@pytest.mark.parametrize("key", ["", "a", "AB" * 32, "ab" * 31 + "zz", "../victim/x", "ab" * 32 + "\0",
                                 "ab" * 32 + "_x", None, b"ab" * 32, "ab" * 33])
def test_bad_keys_are_typed_errors(key):
    with pytest.raises(InvalidKey) as err:
        check_key(key)
    assert isinstance(err.value, TransferError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("suffix", ["/x", "_a/b", "..", "_a\0", "_a\n", "_" + "x" * 200, 3])
def test_bad_suffixes_are_config_errors(suffix):
    with pytest.raises(StorageConfigError):
        check_suffix(suffix)


def test_good_suffixes():
    for s in ("", "__0_1", "_meta-llama-Llama-3.1-8B_0_1_cp1_2", "_m_0_2_4_1"):
        assert check_suffix(s) == s


@pytest.mark.parametrize("args", [("", "bfloat16", (1,)), ("x" * 17, "bfloat16", (1,)),
                                  ("raw", "bfloat16", (0,)), ("raw", "u8", tuple([1] * 9))])
def test_bad_formats(args):
    with pytest.raises(StorageConfigError):
        PageFormat(*args)


def test_a_good_key_is_returned_and_a_bad_one_is_named_in_the_error():
    assert check_key(KEY) == KEY
    with pytest.raises(InvalidKey, match=r"64 lowercase hex characters.*'\.\./victim/x'"):
        check_key("../victim/x")


def test_a_seal_of_another_version_or_another_magic_is_not_decoded_as_ours():
    s = seal(NAME, BF16, os.urandom(4096))
    assert decode_seal(s) is not None
    newer = s[:4] + bytes([s[4] + 1]) + s[5:]  # our magic, a version this reader does not know
    foreign = b"XXXX" + s[4:]  # our version byte after another magic
    for head in (newer, foreign):
        assert decode_seal(head) is None


def test_raw_format_is_each_pages_own_format_however_often_and_in_whatever_order_it_is_asked():
    pages = [torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.uint8),
             torch.zeros(4, 8, dtype=torch.float16), torch.zeros(8, 4, dtype=torch.bfloat16)]
    for _ in range(2):  # the second round is answered from the cache
        for page in pages:
            assert raw_format(page) == PageFormat.raw(page)


def test_the_ownership_rule_protects_exactly_the_pages_a_seal_proves_another_deployment_wrote():
    """``written_by_another``: a decodable seal describing the stored bytes and naming another
    page or another format is proof; nothing else is (those stay repairable and removable)."""
    page = os.urandom(4096)
    head_dim_first = PageFormat.of("page_head", torch.bfloat16, (2, 2, 4, 2, 64))
    ours = seal(NAME, BF16, page)
    assert not written_by_another(ours, 4096, NAME, BF16)  # our own page
    assert not written_by_another(ours, None, NAME, None)
    # another host layout, another dtype: the same name, the same size, another format
    assert written_by_another(seal(NAME, head_dim_first, page), 4096, NAME, BF16)
    fp16 = PageFormat.of("page_first", torch.float16, (2, 4, 2, 2, 64))
    assert written_by_another(seal(NAME, fp16, page), 4096, NAME, BF16)
    fp8 = PageFormat.of("page_first", torch.float8_e4m3fn, (2, 4, 2, 2, 64))
    assert written_by_another(seal(NAME, fp8, page[:2048]), 2048, NAME, BF16)  # another size too
    # another page name (another attention-CP rank under Mooncake's shared object names)
    other_name = KEY + "_m_0_1_cp1_2"
    assert written_by_another(seal(other_name, BF16, page), 4096, NAME, BF16)
    assert written_by_another(seal(other_name, BF16, page), None, NAME, None)
    assert not written_by_another(seal(NAME, head_dim_first, page), 4096, NAME, None)  # format unknown
    # no proof: no seal, not a seal, a seal not describing what is stored, our format over another size
    assert not written_by_another(None, 4096, NAME, BF16)
    assert not written_by_another(b"x" * SEAL_NBYTES, 4096, NAME, BF16)
    assert not written_by_another(ours[:50], 4096, NAME, BF16)
    assert not written_by_another(seal(NAME, head_dim_first, page), 4000, NAME, BF16)  # torn / truncated
    assert not written_by_another(seal(NAME, BF16, page + page), 8192, NAME, BF16)
    newer = bytearray(seal(NAME, head_dim_first, page))
    newer[4] = 3  # a seal of another version
    assert not written_by_another(bytes(newer), 4096, NAME, BF16)

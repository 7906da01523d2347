import os

import numpy as np
import pytest

from transfer.checksum import page_checksum


@pytest.mark.parametrize("size", [0, 1, 7, 8, 4096, 4099, 2 << 20])
def test_every_single_bit_flip_is_detected(size):
    rng = np.random.default_rng(size)
    page = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    good = page_checksum(page)
    positions = range(size * 8) if size <= 64 else rng.integers(0, size * 8, 500)
    for bit in positions:
        page[bit // 8] ^= 1 << (bit % 8)
        assert page_checksum(page) != good, bit
        page[bit // 8] ^= 1 << (bit % 8)
    assert page_checksum(page) == good


def test_truncation_zeroed_words_and_swaps_change_it():
    page = os.urandom(4096)
    good = page_checksum(page)
    assert page_checksum(page[:-8]) != good
    assert page_checksum(page[:8] + b"\0" * 8 + page[16:]) != good
    assert page_checksum(page[8:16] + page[:8] + page[16:]) != good
    assert page_checksum(page + b"\0") != good


def test_accepts_any_contiguous_buffer():
    data = np.arange(512, dtype=np.float16)
    assert page_checksum(data) == page_checksum(data.tobytes()) == page_checksum(memoryview(data.tobytes()))


def test_two_sign_bit_flips_are_detected():
    # the weighted word sum it replaced missed every pair of bit-63 flips (the weights cancel)
    rng = np.random.default_rng(3)
    page = bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    good = page_checksum(page)
    for _ in range(500):
        i, j = rng.choice(512, 2, replace=False)
        page[i * 8 + 7] ^= 0x80
        page[j * 8 + 7] ^= 0x80
        assert page_checksum(page) != good
        page[i * 8 + 7] ^= 0x80
        page[j * 8 + 7] ^= 0x80

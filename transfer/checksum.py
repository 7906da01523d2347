"""The page checksum: XXH3-128 (the ``xxhash`` library), optionally bound to a page descriptor.

``page_checksum(data)`` is XXH3-128 of the bytes alone, as a 128-bit int. The storage tiers do not
use it directly: they seal every page with ``transfer.storage.integrity.seal``, whose digest is
XXH3-128 over a descriptor (page name, host layout, dtype, shape, size) followed by the bytes, so a
page renamed onto another key or a same-size page of another format is refused as well as changed
bytes. See ``transfer/storage/integrity.py`` for what is guaranteed and what is probabilistic.

Why XXH3-128: measured on this 2-core VM (bench command and figures in docs/storage.md), it runs at
11 GB/s on 4 KiB pages (call overhead) and 80-110 GB/s on 64 KiB - 8 MiB pages, against 9-11 GB/s
for CRC32C (``crc32c`` / ``google-crc32c``), 3-4 GB/s for zlib.crc32 and 1-9 GB/s for the weighted
word sum it replaces (which missed two flips of bit 63, i.e. two fp16/bf16 sign bits). A 128-bit
digest makes an accidental match ~2**-128; a 32-bit CRC would be 2**-32 for corruption beyond its
guaranteed burst/Hamming classes.
"""

from __future__ import annotations

import xxhash


def page_checksum(data) -> int:
    """XXH3-128 of a bytes-like page (``bytes``, ``memoryview``, contiguous array), as an int."""
    return xxhash.xxh3_128_intdigest(memoryview(data).cast("B"))

"""Pure page hashing: the chain that names KV pages in shared storage, and the storage keys."""

from hashing.chain import (
    TokenRangeError,
    extend_chain,
    hash_page,
    namespace_seed,
    page_hashes,
)
from hashing.keys import storage_key, storage_suffix

__all__ = [
    "TokenRangeError",
    "extend_chain",
    "hash_page",
    "namespace_seed",
    "page_hashes",
    "storage_key",
    "storage_suffix",
]

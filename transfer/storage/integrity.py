"""What a stored page is, and the seal that proves a page is exactly the page that was asked for.

One format for every tier (file: the seal is an extended attribute of the page file; Redis and
other servers: the seal is a header in front of the page bytes; memory: kept next to the bytes).

**Keys.** A storage key is a page hash: 64 lowercase hex characters (``check_key``). The name a
page is stored under is ``{key}{suffix}`` (SGLang HiCacheFile naming); ``check_suffix`` refuses
suffixes that could leave the store's directory or confuse the name parser.

**Page format.** ``PageFormat(layout, dtype, shape)`` says what the bytes are: the host layout
(``"page_first"``, SGLang's default host layout, for the transfer stack; ``"raw"`` for a store
told nothing), the element dtype name (``"bfloat16"``) and the page shape
(``(2, page_size, layers, heads, head_dim)`` for page_first MHA).

**The seal** (``SEAL_NBYTES`` = 104 bytes, little endian)::

    magic b"KVLP" | version u8 (=2) | ndim u8 | 2 pad | nbytes u64 |
    digest 16 bytes: XXH3-128 over (descriptor || page bytes) |
    name fingerprint u64: XXH3-64 of the page name |
    layout 16 bytes ASCII NUL padded | dtype 16 bytes ASCII NUL padded | shape 8 x u32

where the descriptor is ``b"kvlp2\\0{name}\\0{layout}\\0{dtype}\\0{d0}x{d1}...\\0{nbytes}"``.

**What ``verify`` guarantees** (deterministic: exact field comparisons):
  * a page whose recorded layout, dtype, shape or size differs from the reader's is refused
    (``Verdict.FOREIGN``, or ``WRONG_SIZE`` when the byte count differs) — so a same-size page of
    another dtype (fp16 vs bf16) or another SGLang host layout is never served;
  * a value that is not a seal (wrong magic/version, truncated) is refused (``CORRUPT``).

**What is probabilistic** (hash-based): a page renamed onto another key passes only if the two
names' XXH3-64 fingerprints collide *and* the XXH3-128 digests collide; changed page bytes of the
right length pass only if the XXH3-128 digest collides. XXH3-128 is a non-cryptographic hash with
full avalanche (it passes SMHasher); for accidental corruption the chance that a changed page still
verifies is about 2**-128, independent of the pattern (multi-bit flips, compensating word
changes, swapped words, zeroed blocks). It gives no guaranteed minimum Hamming distance (unlike a
CRC) and does not resist deliberate forgery: it detects corruption and mix-ups, not tampering.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Sequence

import msgspec
import torch
import xxhash

from transfer.errors import InvalidKey, StorageConfigError

KEY_HEX_LEN = 64
_KEY_RE = re.compile(r"[0-9a-f]{64}\Z")
MAGIC = b"KVLP"
SEAL_VERSION = 2
MAX_DIMS = 8
_MAGIC_VERSION = MAGIC + bytes([SEAL_VERSION])
_SEAL = struct.Struct("<4sBB2xQ16sQ16s16s8I")
SEAL_NBYTES = _SEAL.size  # 104
_NAME_MAX = 255 - len(".bin") - 1 - len(".0123456789abcdef0123456789abcdef.tmp")  # room for the temp name
_SUFFIX_BAD = re.compile(r"[/\\\x00-\x1f\x7f]")


def check_key(key: object) -> str:
    """``key`` if it is a page hash (64 lowercase hex characters).

    Raises:
        InvalidKey: anything else (a path, a NUL, upper case, another length, not a str).
    """
    if type(key) is not str or _KEY_RE.match(key) is None:
        raise InvalidKey(f"storage key must be 64 lowercase hex characters (a page hash), got {key!r:.90}")
    return key


def check_keys(keys: Sequence[object]) -> None:
    """Every key of a batch, before any page is touched. Raises InvalidKey on the first bad one."""
    for key in keys:
        if type(key) is not str or _KEY_RE.match(key) is None:
            check_key(key)


def check_suffix(suffix: object) -> str:
    """``suffix`` if it can follow a key in a file name and a server key.

    Raises:
        StorageConfigError: not a str, a path separator or control character, ``..``, or a name
            too long for a file system (255 bytes with the hash, ``.bin`` and the temp-file tail).
    """
    if not isinstance(suffix, str) or _SUFFIX_BAD.search(suffix) or ".." in suffix:
        raise StorageConfigError(f"storage suffix must be a str without '/', '\\\\', '..' or control characters, "
                                 f"got {suffix!r:.90}")
    if KEY_HEX_LEN + len(suffix.encode()) > _NAME_MAX:
        raise StorageConfigError(f"storage suffix is too long for a file name ({len(suffix.encode())} bytes)")
    return suffix


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a str is returned as given)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class PageFormat(msgspec.Struct, frozen=True):
    """What a page's bytes are: host ``layout`` name, element ``dtype`` name, page ``shape``."""

    layout: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        for what, text in (("layout", self.layout), ("dtype", self.dtype)):
            if not isinstance(text, str) or not text or len(text.encode()) > 16 or not text.isascii() \
                    or "\0" in text:
                raise StorageConfigError(f"page format {what} must be 1..16 ASCII characters, got {text!r}")
        if len(self.shape) > MAX_DIMS or any(not isinstance(d, int) or not 0 < d < 2**32 for d in self.shape):
            raise StorageConfigError(f"page shape must be <= {MAX_DIMS} dims in 1..2**32-1, got {self.shape!r}")

    @classmethod
    def of(cls, layout: str, dtype: torch.dtype | str, shape: Sequence[int]) -> "PageFormat":
        """Build from a torch dtype (or its name) and any int sequence."""
        return cls(layout, dtype_name(dtype), tuple(int(d) for d in shape))

    @classmethod
    def raw(cls, page: torch.Tensor) -> "PageFormat":
        """The format of a store told nothing: layout ``"raw"``, the tensor's own dtype and shape."""
        return cls("raw", dtype_name(page.dtype), tuple(int(d) for d in page.shape))

    def descriptor(self, name: str, nbytes: int) -> bytes:
        """The bytes hashed in front of the page: binds the digest to the name and the format."""
        return b"kvlp2\0" + name.encode() + _packed(self)[1] + b"%d" % nbytes


_PACKED: dict[PageFormat, tuple[bytes, bytes]] = {}


def _packed(fmt: PageFormat) -> tuple[bytes, bytes]:
    """(the seal's format fields ``ndim u8 | layout | dtype | shape``, the descriptor's middle)."""
    got = _PACKED.get(fmt)
    if got is None:
        dims = list(fmt.shape) + [0] * (MAX_DIMS - len(fmt.shape))
        fields = struct.pack("<B", len(fmt.shape)) + struct.pack("<16s16s8I", fmt.layout.encode(),
                                                                  fmt.dtype.encode(), *dims)
        middle = f"\0{fmt.layout}\0{fmt.dtype}\0{'x'.join(str(d) for d in fmt.shape)}\0".encode()
        got = (fields, middle)
        if len(_PACKED) < 256:
            _PACKED[fmt] = got
    return got


_RAW: dict[tuple, PageFormat] = {}


def raw_format(page: torch.Tensor) -> PageFormat:
    """``PageFormat.raw(page)``, cached per (dtype, shape)."""
    key = (page.dtype, page.shape)
    fmt = _RAW.get(key)
    if fmt is None:
        fmt = PageFormat.raw(page)
        if len(_RAW) < 256:
            _RAW[key] = fmt
    return fmt


class Verdict(str, enum.Enum):
    """The outcome of ``verify``."""

    OK = "ok"
    CORRUPT = "corrupt"  # not a seal, or the digest does not match the bytes
    FOREIGN = "foreign"  # a valid seal of another name or another format (layout, dtype, shape)
    WRONG_SIZE = "wrong_size"  # the seal's byte count differs from the reader's page size


def page_digest(name: str, fmt: PageFormat, data) -> bytes:
    """XXH3-128 (16 bytes) over ``fmt.descriptor(name, len)`` then the page bytes ``data``."""
    view = memoryview(data).cast("B")
    h = xxhash.xxh3_128(fmt.descriptor(name, view.nbytes))
    h.update(view)
    return h.digest()


def name_fingerprint(name: str) -> int:
    """XXH3-64 of the page name (in the seal, so a renamed page is refused without its bytes)."""
    return xxhash.xxh3_64_intdigest(name.encode())


def seal(name: str, fmt: PageFormat, data) -> bytes:
    """The ``SEAL_NBYTES`` seal of page ``data`` stored under ``name`` with format ``fmt``."""
    view = memoryview(data).cast("B")
    fields = _packed(fmt)[0]
    return b"".join((_MAGIC_VERSION, fields[:1], b"\0\0", view.nbytes.to_bytes(8, "little"),
                     page_digest(name, fmt, view), name_fingerprint(name).to_bytes(8, "little"), fields[1:]))


class Seal(msgspec.Struct, frozen=True):
    """A decoded seal."""

    nbytes: int
    digest: bytes
    name_fp: int
    format: PageFormat


def decode_seal(value) -> Seal | None:
    """The seal at the start of ``value`` (bytes-like), or None when it is not one of ours."""
    if len(value) < SEAL_NBYTES:
        return None
    magic, version, ndim, nbytes, digest, name_fp, layout, dtype, *dims = _SEAL.unpack_from(value)
    if magic != MAGIC or version != SEAL_VERSION or ndim > MAX_DIMS:
        return None
    try:
        fmt = PageFormat(layout.rstrip(b"\0").decode("ascii"), dtype.rstrip(b"\0").decode("ascii"),
                         tuple(dims[:ndim]))
    except (UnicodeDecodeError, StorageConfigError):
        return None
    return Seal(nbytes, digest, name_fp, fmt)


def check_seal(sealed: Seal | None, name: str, fmt: PageFormat, nbytes: int) -> Verdict:
    """The deterministic part of ``verify`` (no page bytes needed: usable by an existence check)."""
    if sealed is None:
        return Verdict.CORRUPT
    if sealed.nbytes != nbytes:
        return Verdict.WRONG_SIZE
    if sealed.format != fmt or sealed.name_fp != name_fingerprint(name):
        return Verdict.FOREIGN
    return Verdict.OK


def written_by_another(seal_bytes, stored_nbytes: int | None, name: str, fmt: PageFormat | None) -> bool:
    """**The ownership rule** of every tier: whether the seal stored with the page under ``name``
    proves that another deployment wrote that page — so this store never overwrites, repairs,
    evicts or deletes it (for this store it is a ``foreign`` miss, counted ``foreign_kept`` where
    a write, an eviction or a delete left it alone).

    Proof is a seal that decodes, describes the bytes stored (its byte count is
    ``stored_nbytes``, when known) and names another page or another format: a name fingerprint
    other than ``name``'s (e.g. another attention-CP rank under Mooncake's shared object names),
    or — when ``fmt`` is given — another layout, dtype or shape (another host layout, fp8 vs
    bf16). Nothing else proves anything: no seal (SGLang's pages, ``checksum=False``), a value
    that is not a seal, a seal whose byte count is not what is stored (torn, truncated), or a
    seal of our own name and format over another byte count (not a page another deployment can
    write) — those stay repairable and removable as before.

    Args:
        seal_bytes: the stored seal (or the first ``SEAL_NBYTES`` of the value); None: none.
        stored_nbytes: the page bytes stored under ``name`` (None: unknown, not compared).
        name: the page name this store reads and writes (the name it seals).
        fmt: this store's page format for that page (None: unknown, only the name is compared).
    """
    if seal_bytes is None:
        return False
    sealed = decode_seal(bytes(seal_bytes[:SEAL_NBYTES]))
    if sealed is None or (stored_nbytes is not None and sealed.nbytes != stored_nbytes):
        return False
    if sealed.name_fp != name_fingerprint(name):
        return True
    return fmt is not None and sealed.format != fmt


def verify(seal_bytes, name: str, fmt: PageFormat, data) -> Verdict:
    """Whether ``data`` is exactly the page ``name`` of format ``fmt`` that ``seal_bytes`` sealed."""
    view = memoryview(data).cast("B")
    head = bytes(seal_bytes[:SEAL_NBYTES])
    # fast path: compare the seal's raw fields with what this page must have
    if (len(head) == SEAL_NBYTES and head[:5] == _MAGIC_VERSION and head[6:8] == b"\0\0"
            and int.from_bytes(head[8:16], "little") == view.nbytes
            and int.from_bytes(head[32:40], "little") == name_fingerprint(name)
            and head[5:6] + head[40:] == _packed(fmt)[0]):
        return Verdict.OK if page_digest(name, fmt, view) == head[16:32] else Verdict.CORRUPT
    sealed = decode_seal(head)  # slow path: say why
    verdict = check_seal(sealed, name, fmt, view.nbytes)
    if verdict is Verdict.OK and page_digest(name, fmt, view) != sealed.digest:
        return Verdict.CORRUPT
    return verdict

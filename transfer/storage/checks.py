"""Every storage input, checked in one place before anything is written, read or opened.

Each tier (memory, file, Redis, Redis Cluster, Mooncake) calls these at its boundary, so a bad
input gets the same typed error everywhere and changes nothing:

* **pages** (``check_batch``): a whole batch — keys, lengths, and every page tensor — before its
  first page is touched. A page must be a plain contiguous CPU tensor whose bytes the tier can
  store and give back exactly: a dtype of ``BYTE_EXACT_DTYPES`` (complex, quantized, sub-byte and
  ``bits`` dtypes are refused by name: their bytes are not a plain array a tier can copy, seal
  and hand back — a quantized page even crashes the process when viewed as bytes), no conjugate
  or negative bit, no autograd, the strided layout, and ``page_nbytes`` bytes when the tier has a
  page size.
* **construction** (``check_sizes``, ``check_format``, ``check_ttl``): sizes are positive ints
  (``page_nbytes``, capacities, thread and pipeline counts), a declared ``page_format`` describes
  exactly ``page_nbytes`` bytes of a byte-exact dtype, and a TTL is a finite number of seconds in
  ``[MIN_TTL_S, MAX_TTL_S]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from transfer.errors import InvalidPage, PageSizeMismatch, StorageConfigError
from transfer.storage.integrity import PageFormat, check_keys

#: dtypes whose tensors are plain arrays of whole bytes: viewed as ``uint8``, copied, sealed and
#: read back bit-exact by every tier. Anything else is refused by name.
BYTE_EXACT_DTYPES = frozenset(
    getattr(torch, name) for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ) if isinstance(getattr(torch, name, None), torch.dtype)
)
_BY_NAME = {str(d).removeprefix("torch."): d for d in BYTE_EXACT_DTYPES}

MIN_TTL_S = 0.001  # Redis expiries are whole milliseconds
MAX_TTL_S = 10 * 365 * 24 * 3600.0  # ten years: far beyond any KV retention, far below Redis's limit


def _why_not_byte_exact(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if dtype.is_complex:
        return f"{name} is a complex dtype"
    if name.startswith(("q", "quint")):
        return f"{name} is a quantized dtype"
    return f"{name} is not a byte-exact dtype"


def check_page(page: object, page_nbytes: int | None) -> None:
    """One page tensor (see the module docstring).

    Raises:
        InvalidPage: not a tensor, not contiguous or not on the CPU, a dtype outside
            ``BYTE_EXACT_DTYPES`` (named; a conjugate view is complex), a negative view, a tensor
            requiring grad, a sparse or other non-strided layout, a meta tensor.
        PageSizeMismatch: ``page_nbytes`` given and the page has another byte size.
    """
    if not isinstance(page, torch.Tensor):
        raise InvalidPage(f"pages must be contiguous CPU tensors, got {type(page).__name__}")
    if page.dtype not in BYTE_EXACT_DTYPES:  # complex (conjugate views included), quantized, sub-byte
        raise InvalidPage(f"page dtype refused: {_why_not_byte_exact(page.dtype)}; a tier stores plain "
                          f"arrays of bytes ({', '.join(sorted(_BY_NAME))})")
    if page.layout is not torch.strided:
        raise InvalidPage(f"pages must be dense (strided) tensors, got layout {page.layout}")
    if not page.is_cpu or not page.is_contiguous():
        raise InvalidPage("pages must be contiguous CPU tensors")
    if page.is_neg():
        raise InvalidPage("a page must not be a lazy negative view (resolve it first)")
    if page.requires_grad:
        raise InvalidPage("a page must not require grad (pass tensor.detach())")
    if page_nbytes is not None and page.nbytes != page_nbytes:
        raise PageSizeMismatch(f"page of {page.nbytes} bytes, expected {page_nbytes}")


def check_batch(keys: Sequence[str], pages: Sequence[torch.Tensor], page_nbytes: int | None) -> None:
    """The arguments of a batch call, checked before anything is read or written.

    Raises:
        InvalidKey: a key that is not a page hash (64 lowercase hex characters).
        InvalidPage: lengths differ, or a page ``check_page`` refuses.
        PageSizeMismatch: a page of another size than ``page_nbytes`` (when set).
    """
    if len(keys) != len(pages):
        raise InvalidPage(f"{len(keys)} keys for {len(pages)} pages")
    check_keys(keys)
    for page in pages:
        check_page(page, page_nbytes)


def check_size(what: str, value: object, *, optional: bool = True) -> int | None:
    """``value`` if it is an int >= 1 (or None when ``optional``).

    Raises:
        StorageConfigError: a bool, a non-int, zero or negative.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StorageConfigError(f"{what} must be a positive int{' or None' if optional else ''}, got {value!r}")
    return value


def check_sizes(**sizes: object) -> None:
    """``check_size`` of each named optional size (``page_nbytes=..., capacity_bytes=...``)."""
    for what, value in sizes.items():
        check_size(what, value)


def check_seconds(what: str, value: object, *, low: float = 0.0, high: float = math.inf,
                  optional: bool = False) -> float | None:
    """``value`` as a float if it is a finite real number in ``[low, high]`` (None when ``optional``).

    Raises:
        StorageConfigError: a bool, a non-number, NaN, an infinity, or out of range.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StorageConfigError(f"{what} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or not low <= seconds <= high:
        raise StorageConfigError(f"{what} must be finite and within [{low:g}, {high:g}] seconds, got {value!r}")
    return seconds


def check_ttl(ttl_s: object) -> int | None:
    """A page expiry in seconds (None: never) as whole milliseconds.

    Raises:
        StorageConfigError: not a finite number in ``[MIN_TTL_S, MAX_TTL_S]`` (inf, NaN, 1e300,
            zero, negative, a bool or a str).
    """
    seconds = check_seconds("ttl_s", ttl_s, low=MIN_TTL_S, high=MAX_TTL_S, optional=True)
    return None if seconds is None else max(1, round(seconds * 1000))


def format_dtype(page_format: PageFormat) -> torch.dtype:
    """The byte-exact torch dtype a format names.

    Raises:
        StorageConfigError: an unknown dtype name, or one outside ``BYTE_EXACT_DTYPES``.
    """
    dtype = _BY_NAME.get(page_format.dtype)
    if dtype is None:
        known = getattr(torch, page_format.dtype, None)
        why = _why_not_byte_exact(known) if isinstance(known, torch.dtype) else f"{page_format.dtype!r} is not a torch dtype"
        raise StorageConfigError(f"page format refused: {why}")
    return dtype


def check_format(page_format: object, page_nbytes: int | None) -> PageFormat | None:
    """A declared page format: a ``PageFormat`` of a byte-exact dtype that describes exactly
    ``page_nbytes`` bytes (when both are given). Returns it (None stays None).

    Raises:
        StorageConfigError: not a ``PageFormat``, a dtype ``format_dtype`` refuses, or a size
            other than ``page_nbytes``.
    """
    if page_format is None:
        return None
    if not isinstance(page_format, PageFormat):
        raise StorageConfigError(f"page_format must be a PageFormat or None, got {type(page_format).__name__}")
    n = format_dtype(page_format).itemsize
    for d in page_format.shape:
        n *= d
    if page_nbytes is not None and n != page_nbytes:
        raise StorageConfigError(f"page format {page_format} is {n} bytes, page_nbytes is {page_nbytes}")
    return page_format


def check_store(page_nbytes: object, page_format: object, **sizes: object) -> None:
    """What every tier checks at construction: ``page_nbytes`` and each of ``sizes`` a positive
    int or None, and ``page_format`` against ``page_nbytes`` (``check_format``).

    Raises:
        StorageConfigError: the first bad value.
    """
    check_sizes(page_nbytes=page_nbytes, **sizes)
    check_format(page_format, page_nbytes)

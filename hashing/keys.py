"""Storage keys in SGLang HiCacheFile's naming, so other nodes (and SGLang itself) find our pages.

A page's file is ``{page_hash}{suffix}.bin`` where the suffix is ``_{model}`` (``/`` replaced by
``-``), then ``_{tp_rank}_{tp_size}`` unless the model is MLA (whose latent KV is the same on
every rank), then ``_{pp_size}_{pp_rank}`` when pipeline parallel.
"""

from __future__ import annotations


def storage_suffix(
    model_name: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    is_mla: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> str:
    """The per-deployment suffix appended to every page hash.

    Raises:
        ValueError: a rank outside ``0 .. size-1``, a size < 1, or an empty model name.
    """
    if not model_name:
        raise ValueError("model_name must be non-empty")
    for rank, size, what in ((tp_rank, tp_size, "tp"), (pp_rank, pp_size, "pp")):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{what}_rank {rank} is not in 0..{what}_size-1 (size {size})")
    suffix = "_" + model_name.replace("/", "-")
    if not is_mla:
        suffix += f"_{tp_rank}_{tp_size}"
    if pp_size > 1:
        suffix += f"_{pp_size}_{pp_rank}"
    return suffix


def storage_key(page_hash: str, suffix: str) -> str:
    """The key of one page: its hash followed by the deployment suffix (no ``.bin``)."""
    return page_hash + suffix

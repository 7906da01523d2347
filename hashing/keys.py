"""Storage keys in SGLang HiCacheFile's naming, so other nodes (and SGLang itself) find our pages.

A page's file is ``{page_hash}{suffix}.bin`` where the suffix is ``_{model}`` (``/`` replaced by
``-``; an empty model name gives ``_``), then ``_{tp_rank}_{tp_size}`` unless the model is MLA (whose
latent KV is the same on every rank), then ``_{pp_size}_{pp_rank}`` when pipeline parallel, then
``_cp{attn_cp_rank}_{attn_cp_size}`` under attention context parallelism (size > 1) — exactly
``HiCacheFile.__init__``'s ``config_suffix`` in SGLang 0.5.19
(``sglang/srt/mem_cache/hicache_storage.py``).
"""

from __future__ import annotations


def storage_suffix(
    model_name: str | None,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    is_mla: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    attn_cp_rank: int = 0,
    attn_cp_size: int = 1,
) -> str:
    """The per-deployment suffix appended to every page hash (SGLang's ``config_suffix``).

    Args:
        model_name: the served model's name ("" or None: SGLang's unnamed model, suffix ``__0_1``).
        tp_rank, tp_size: tensor-parallel rank and size (omitted from the suffix for MLA).
        is_mla: latent-only KV, identical on every TP rank.
        pp_rank, pp_size: pipeline-parallel rank and size (in the suffix when size > 1).
        attn_cp_rank, attn_cp_size: attention context-parallel rank and size (in the suffix when
            size > 1: each CP rank holds a disjoint slice of every page).
    Raises:
        ValueError: a rank outside ``0 .. size-1``, a size < 1, a non-int rank or size, or a
            model name that is not a str.
    """
    if model_name is None:
        model_name = ""
    if not isinstance(model_name, str):
        raise ValueError(f"model_name must be a str, got {model_name!r}")
    for rank, size, what in ((tp_rank, tp_size, "tp"), (pp_rank, pp_size, "pp"),
                             (attn_cp_rank, attn_cp_size, "attn_cp")):
        if not isinstance(rank, int) or not isinstance(size, int) or isinstance(rank, bool) \
                or isinstance(size, bool) or size < 1 or not 0 <= rank < size:
            raise ValueError(f"{what}_rank {rank!r} is not in 0..{what}_size-1 (size {size!r})")
    suffix = "_" + model_name.replace("/", "-")
    if not is_mla:
        suffix += f"_{tp_rank}_{tp_size}"
    if pp_size > 1:
        suffix += f"_{pp_size}_{pp_rank}"
    if attn_cp_size > 1:
        suffix += f"_cp{attn_cp_rank}_{attn_cp_size}"
    return suffix


def storage_key(page_hash: str, suffix: str) -> str:
    """The key of one page: its hash followed by the deployment suffix (no ``.bin``)."""
    return page_hash + suffix

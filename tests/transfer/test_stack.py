import os

import pytest
import torch

from transfer import FileStorage, MemoryStorage, Offloader, StorageUnavailable, build_stack


def test_memory_stack_shapes():
    s = build_stack(4, 2, 16, torch.bfloat16, 8, 64, 32, 3, 128)
    assert s.kv_pool.buffer.shape == (2, 4, 72, 2, 16)  # +1 padding page
    assert s.allocator.available_size() == 64 and s.host_pool.available_size() == 32
    assert s.req_to_token_pool.req_to_token.shape == (3, 128)
    assert isinstance(s.storage, MemoryStorage) and s.storage.suffix == "_model_0_1"
    assert isinstance(s.offloader, Offloader)
    s.close()


def test_file_stack_mla_suffix(tmp_path):
    s = build_stack(2, 1, 32, torch.float16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}",
                    mla=True, model_name="deepseek-ai/DeepSeek-V3", tp_rank=1, tp_size=2)
    assert isinstance(s.storage, FileStorage) and s.storage.suffix == "_deepseek-ai-DeepSeek-V3"
    assert s.kv_pool.kinds == 1 and s.host_pool.page_nbytes == 4 * 2 * 32 * 2
    s.close()


def test_bad_storage_spec(tmp_path):
    with pytest.raises(ValueError):
        build_stack(1, 1, 4, torch.float16, 4, 16, 16, 1, 16, storage="redis")
    f = tmp_path / "f"
    f.write_bytes(b"")
    with pytest.raises(StorageUnavailable):
        build_stack(1, 1, 4, torch.float16, 4, 16, 16, 1, 16, storage=f"file:{f}/x")


def test_stack_seals_pages_with_the_page_first_host_layout(tmp_path):
    from transfer.storage.file import XATTR
    from transfer.storage.integrity import decode_seal

    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}",
                    model_name="org/m", tp_rank=1, tp_size=2, attn_cp_rank=1, attn_cp_size=2)
    assert s.storage.suffix == "_org-m_1_2_cp1_2"
    fmt = s.storage.page_format
    assert (fmt.layout, fmt.dtype, fmt.shape) == ("page_first", "bfloat16", (2, 4, 2, 2, 8))
    key = "ab" * 32
    assert s.storage.batch_set([key], [s.host_pool.page_bytes(0)]) == [True]
    sealed = decode_seal(os.getxattr(tmp_path / f"{key}{s.storage.suffix}.bin", XATTR))
    assert sealed.format == fmt
    s.close()
    mla = build_stack(2, 1, 32, torch.float16, 4, 16, 16, 1, 16, mla=True)
    assert mla.storage.page_format.shape == (4, 2, 1, 32)  # SGLang's MLA page_first page
    mla.close()

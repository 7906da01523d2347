import pytest
import torch

from transfer import BadIndices, KVPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_write_read_bit_exact(dtype, mla):
    pool = KVPool(3, 1 if mla else 2, 8, dtype, 32, mla=mla)
    slots = torch.tensor([5, 9, 30])
    vals = synthetic_kv(pool, 7, torch.tensor([0, 1, 2]))
    pool.write(slots, vals)
    assert torch.equal(pool.read(slots).view(torch.uint8), vals.view(torch.uint8))
    assert pool.buffer.shape == (1 if mla else 2, 3, 32, 1 if mla else 2, 8)


def test_layout_is_per_layer_contiguous():
    pool = KVPool(2, 2, 4, torch.float16, 16)
    assert pool.k_buffer(1).is_contiguous() and pool.k_buffer(1).shape == (16, 2, 4)
    assert pool.v_buffer(0).data_ptr() == pool.buffer[1, 0].data_ptr()
    with pytest.raises(TypeError):
        KVPool(2, 1, 4, torch.float16, 16, mla=True).v_buffer(0)


def test_synthetic_kv_differs_by_request_and_position():
    pool = KVPool(1, 1, 16, torch.bfloat16, 8)
    a = synthetic_kv(pool, 1, torch.tensor([0, 1])).view(torch.uint8)
    b = synthetic_kv(pool, 2, torch.tensor([0, 1])).view(torch.uint8)
    assert not torch.equal(a, b) and not torch.equal(a[:, :, 0], a[:, :, 1])
    assert torch.equal(a, synthetic_kv(pool, 1, torch.tensor([0, 1])).view(torch.uint8))


def test_bad_input():
    pool = KVPool(1, 1, 4, torch.float32, 8)
    with pytest.raises(BadIndices):
        pool.read(torch.tensor([8]))
    with pytest.raises(ValueError):
        pool.write(torch.tensor([1]), torch.zeros(2, 1, 2, 1, 4))
    with pytest.raises(ValueError):
        KVPool(1, 2, 4, torch.float32, 8, mla=True)


def test_buffer_lives_on_the_device_asked_for():
    pool = KVPool(2, 1, 4, torch.float16, 8, device="meta")  # any non-CPU device; "meta" holds no memory
    assert pool.buffer.device.type == "meta" and pool.device.type == "meta"


def test_write_and_read_move_host_slots_and_values_to_the_pool_device():
    pool = KVPool(2, 1, 4, torch.float16, 8, device="meta")
    slots = torch.tensor([1, 2, 5])
    pool.write(slots, torch.zeros(2, 2, 3, 1, 4, dtype=torch.float16))  # host slots and values
    got = pool.read(slots)
    assert got.device.type == "meta" and got.shape == (2, 2, 3, 1, 4)

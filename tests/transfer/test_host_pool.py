import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from transfer import BadIndices, DoubleFree, HostPool, NotAllocated, PinningFailed
from transfer import host_pool as host_pool_mod


def test_page_first_layout_and_contiguous_page():
    hp = HostPool(3, 2, 4, torch.bfloat16, 8, 32)
    assert hp.buffer.shape == (4, 2, 8, 3, 2, 4)  # [pages, K/V, page_size, layers, heads, dim]
    assert hp.page_nbytes == 2 * 8 * 3 * 2 * 4 * 2
    v = hp.page_view(2)
    assert v.is_contiguous() and v.shape == (2, 8, 3, 2, 4)
    b = hp.page_bytes(2)
    assert b.dtype == torch.uint8 and b.numel() == hp.page_nbytes
    assert b.data_ptr() == hp.buffer.data_ptr() + 2 * hp.page_nbytes
    assert hp.pinned == torch.cuda.is_available()


def test_mla_layout():
    hp = HostPool(3, 1, 16, torch.float16, 4, 8, mla=True)
    assert hp.buffer.shape == (2, 1, 4, 3, 1, 16)


def test_alloc_free_and_double_free():
    hp = HostPool(1, 1, 4, torch.float32, 4, 16)
    a = hp.alloc(5)
    assert a.tolist() == list(range(8))
    assert hp.available_size() == 8
    hp.free(a)
    with pytest.raises(DoubleFree):
        hp.free(a)
    with pytest.raises(NotAllocated):
        hp.free(torch.arange(8, 12))
    with pytest.raises(BadIndices):
        hp.free(torch.tensor([1, 2, 3, 4]))  # not page aligned
    with pytest.raises(BadIndices):
        hp.free(torch.arange(16, 20))
    assert hp.available_size() == 16
    hp.check_integrity()
    assert hp.alloc(17) is None


# -- pinning and unpinning against a stand-in CUDA runtime (no GPU needed) ---------------------

class FakeCudart:
    def __init__(self, register_rc=0, unregister_rc=0):
        self.register_rc, self.unregister_rc = register_rc, unregister_rc
        self.unregistered = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        return self.register_rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return self.unregister_rc

    def cudaGetErrorString(self, rc):
        return f"error {rc}"


def test_pin_without_cuda_raises_saying_why(monkeypatch):
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: None)
    with pytest.raises(PinningFailed, match=r"\(CUDA is not available\); pass allow_pageable=True"):
        HostPool(1, 1, 4, torch.float32, 4, 8, pin=True)


def test_register_failure_names_bytes_rc_and_error(monkeypatch):
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: FakeCudart(register_rc=7))
    with pytest.raises(PinningFailed, match=r"cudaHostRegister of 256 bytes failed \(rc=7, error 7\)"):
        HostPool(1, 1, 4, torch.float32, 4, 8, pin=True)
    with capture_logs() as logs:
        hp = HostPool(1, 1, 4, torch.float32, 4, 8, pin=True, allow_pageable=True)
    assert hp.pinned is False
    assert logs == [{"event": "host_pool.pin_failed", "log_level": "warning",
                     "error": "cudaHostRegister of 256 bytes failed (rc=7, error 7)",
                     "bytes": 256, "fallback": "pageable"}]


def test_pinned_when_cuda_is_available_and_close_unpins_once(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: cudart)
    hp = HostPool(1, 1, 4, torch.float32, 4, 8)  # pin=None: pinned iff CUDA is available
    assert hp.pinned is True
    hp.close()
    hp.close()
    assert hp.pinned is False and cudart.unregistered == [hp.buffer.data_ptr()]


@pytest.mark.parametrize("rc", [0, 1, 3])
def test_unregister_failure_is_logged(monkeypatch, rc):
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: FakeCudart(unregister_rc=rc))
    with capture_logs() as logs:
        host_pool_mod._unregister(torch.zeros(4))
    want = [] if rc == 0 else [{"event": "host_pool.unregister_failed", "log_level": "warning",
                                "rc": rc, "error": f"error {rc}"}]
    assert logs == want


def test_bad_host_indices_are_named_so():
    hp = HostPool(1, 1, 4, torch.float32, 4, 16)
    with pytest.raises(BadIndices, match=r"^host indices are not whole"):
        hp.page_ids(torch.tensor([1, 2, 3, 4]))
    assert np.array_equal(hp.page_ids(torch.arange(4, 12)), [1, 2])


def test_keep_pinned_makes_close_a_no_op_and_holds_the_pool(monkeypatch):
    """A copy abandoned at shutdown may still write into the pool: ``keep_pinned`` leaves it
    registered (``close`` does nothing) and alive (held by the module) until the process ends."""
    cudart = FakeCudart()
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: cudart)
    monkeypatch.setattr(host_pool_mod, "_KEPT", [])
    hp = HostPool(1, 1, 4, torch.float32, 4, 8, pin=True)
    hp.keep_pinned()
    hp.keep_pinned()
    hp.close()
    assert hp.pinned is True and hp.kept and cudart.unregistered == []
    assert host_pool_mod._KEPT == [hp]
    del hp
    import gc

    gc.collect()
    assert cudart.unregistered == []  # not collected: never unpinned under the copy


@pytest.mark.parametrize("scenario", ["unclosed", "kept"])
def test_a_pinned_pool_is_never_unregistered_at_interpreter_exit(scenario, tmp_path):
    """The finalizer unpins a pool collected unclosed, never at exit (a copy abandoned at shutdown
    may still write into it then; the process's end releases the registration anyway)."""
    from tests.support.pinned_exit import run

    assert run(scenario, tmp_path) == ["pinned True", "end of run"]

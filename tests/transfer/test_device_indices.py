"""``HostOffloader.write`` of slot ids that live on the device (issue 25, point 1): never read on the
scheduler thread; shape checked at once, values where the copy runs (a bad chunk is a failed copy).
The device is the CPU stand-in of ``lifecycle_tools.testkit.sync_trap``."""

from __future__ import annotations

import pytest
import torch

from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync
from transfer import BadIndices, HostOffloader, HostPool, KVPool, MemoryStorage
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from transfer.indices import on_host
from tests.support.transfer_helpers import drain, polls

PS = 4


def make():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 32)
    return HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes)), kv, host


def test_a_device_write_lands_bit_exact_without_a_host_read():
    off, kv, host = make()
    slots = torch.arange(8, 16)
    kv.write(slots, synthetic_kv(kv, 1, torch.arange(8)))
    dev = as_device_resident(slots.clone())
    assert not on_host(dev) and on_host(slots)
    with no_host_sync():
        h = off.write(dev, ack_id=1)
        dev[:] = 0  # the caller reuses its buffer at once: the copy has its own
        assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == []
    for i, page in enumerate(host.page_ids(h).tolist()):
        want = kv.read(slots[i * PS:(i + 1) * PS]).permute(0, 2, 1, 3, 4)
        assert torch.equal(host.page_view(page).view(torch.int16), want.contiguous().view(torch.int16))
    off.close()


@pytest.mark.parametrize("ids", [[8, 9, 10, 12], [6, 7, 8, 9], [60, 61, 62, 63, 64, 65, 66, 67]],
                         ids=["not-consecutive", "not-aligned", "outside-the-pool"])
def test_bad_device_slot_values_fail_the_copy_instead_of_raising(ids):
    off, kv, host = make()
    with no_host_sync():
        assert off.write(as_device_resident(torch.tensor(ids)), ack_id=2) is not None
        assert drain(polls(off).ended, 1) == [2]
        assert polls(off).failed() == [2]  # its host pages are poisoned: never stored
    assert off.stats().copy_failures == 1
    off.close()


@pytest.mark.parametrize("bad", [torch.arange(8, 14), torch.arange(8, 16).view(2, 4), torch.arange(8, 16.0)],
                         ids=["partial-page", "2-d", "float"])
def test_what_can_be_checked_without_reading_is_refused_at_once(bad):
    off, kv, host = make()
    with no_host_sync(), pytest.raises(BadIndices):
        off.write(as_device_resident(bad), ack_id=3)
    assert off.idle() and host.available_size() == 32
    off.close()

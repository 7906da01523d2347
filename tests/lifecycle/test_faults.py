"""The manager over the real transfer stack when copies fail or get stuck (issue 7)."""

import time

import torch

from lifecycle import State
from tests.support.decode_driver import Scheduler
from tests.transfer.test_faults import Clock, GatedCopyEngine
from transfer import HostOffloader, build_stack


def stuck_stack(**engine_sets):
    stack = build_stack(2, 2, 8, torch.float16, 4, device_tokens=256, host_tokens=64, rows=8, max_len=64)
    stack.offloader.close()
    engine, clock = GatedCopyEngine(), Clock()
    for name, acks in engine_sets.items():
        getattr(engine, name).update(acks)
    stack.offloader = HostOffloader(stack.kv_pool, stack.host_pool, stack.storage, copy_engine=engine,
                                    write_timeout_s=1.0, clock=clock)
    return stack, engine, clock


def poll_until(sched, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, sched.mgr.stats()
        sched.mgr.check_offload_progress()
        time.sleep(0.002)


def decode_two_chunks(sched):
    req = sched.admit(1, list(range(8)), 100)
    for t in range(9):
        sched.step(t)
    assert sched.mgr.stats().chunks_enqueued == 2       # [8, 12) ack 1 and [12, 16) ack 2
    return req


def test_a_stuck_copy_expires_the_request_releases_and_its_slots_wait_for_the_copy():
    stack, engine, clock = stuck_stack(hold={1})
    free0, host0 = stack.allocator.available_size(), stack.host_pool.available_size()
    sched = Scheduler(stack)
    req = decode_two_chunks(sched)
    poll_until(sched, lambda: sched.mgr.stats().unsettled == 1)          # ack 2 landed: it waits for ack 1
    assert sched.mgr.stats().inflight_storage == 0                        # (its pages' parent) to end
    sched.finish(req)
    assert sched.mgr.state_of(req) is State.FINISHED                    # ack 1 still reads [8, 12)
    clock.t += 2.0                                                        # past its deadline
    sched.mgr.check_offload_progress()
    s = sched.mgr.stats()
    assert sched.mgr.state_of(req) is State.RELEASED
    assert (s.copies_expired, s.quarantined_slots) == (1, 4)
    assert stack.allocator.available_size() == free0 - 4                 # all but the stuck copy's page
    assert not sched.mgr.idle()
    engine.gate.set()                                                     # the copy finally ends
    sched.settle()
    s = sched.mgr.stats()
    assert stack.allocator.available_size() == free0 and stack.host_pool.available_size() == host0
    assert (s.quarantined_slots, s.leaked, s.released) == (0, 0, 1)
    hashes = [h for h, _ in sched.kv_pages(req)]
    assert stack.storage.batch_exists(hashes[:1]) == 0                    # the expired page: never stored
    assert stack.storage.batch_exists(hashes[1:2]) == 1
    stack.allocator.check_integrity()
    stack.close()


def test_a_failed_copy_is_not_stored_and_nothing_leaks():
    stack, engine, _ = stuck_stack(fail={1})
    free0, host0 = stack.allocator.available_size(), stack.host_pool.available_size()
    sched = Scheduler(stack)
    req = decode_two_chunks(sched)
    sched.finish(req)
    sched.settle()
    s = sched.mgr.stats()
    assert sched.mgr.state_of(req) is State.RELEASED and s.copy_failures == 1 and s.leaked == 0
    assert stack.allocator.available_size() == free0 and stack.host_pool.available_size() == host0
    hashes = [h for h, _ in sched.kv_pages(req)]
    assert stack.storage.batch_exists(hashes[:1]) == 0 and stack.storage.batch_exists(hashes[1:2]) == 1
    stack.close()

"""The scheduler side's offloader (``lifecycle.integrations.vllm.proxy``): host pages and ids chosen
here, jobs recorded in order, completions counted across ranks and reported once (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from lifecycle.integrations.vllm.jobs import Free, Report, Store, Write
from lifecycle.integrations.vllm.proxy import ProxyOffloader
from transfer.errors import BadIndices, DoubleFree

PS = 4


def _slots(blocks):
    return (torch.tensor(blocks).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)


def test_a_write_chooses_host_pages_and_records_the_copy_job():
    p = ProxyOffloader(PS, host_pages=3, device_slots=16 * PS)
    p.req_id = "r"
    host = p.write(_slots([7, 2]), ack_id=1)
    assert host.tolist() == list(range(2 * PS))
    assert p.take_jobs() == [Write(1, "r", [7, 2], [0, 1])] and p.take_jobs() == []
    assert p.write(_slots([3, 4]), ack_id=2) is None and p.rejected == 1    # one page left: refused whole
    assert p.take_jobs() == []
    with pytest.raises(BadIndices):
        p.write(torch.arange(3), ack_id=3)                                  # not a whole page
    assert p.in_flight("r") == [1]


def test_a_copy_ends_when_every_rank_saw_it_end_and_fails_when_any_rank_failed():
    p = ProxyOffloader(PS, host_pages=8, device_slots=16 * PS, world=2)
    for ack in (1, 2):
        p.write(_slots([ack]), ack_id=ack)
    p.absorb(Report(ended={1: 1, 2: 1}, failed={2: 1}, expired={1: 1}))
    r = p.finished_writes()
    assert (r.landed, r.failed, r.expired) == ([], [], [1])                 # expired: told at once
    p.absorb(Report(ended={1: 1, 2: 1}, expired={1: 1}))
    r = p.finished_writes()
    assert (r.landed, r.failed, r.expired) == ([1], [2], [])                # expired told once only
    assert p.finished_writes().landed == [] and p.idle()


def test_storage_ops_finish_when_every_rank_finished_and_frees_are_recorded_in_order():
    p = ProxyOffloader(PS, host_pages=4, device_slots=16 * PS, world=2)
    host = p.write(_slots([1]), ack_id=1)
    op = p.write_storage(host, list(range(PS)), ["a" * 64], None)
    p.absorb(Report(stored={op: 1}, store_failed={op: 1}))
    assert p.finished_storage() == []
    p.absorb(Report(stored={op: 1}))
    assert p.finished_storage() == [op] and p.failed_storage() == {op}
    p.free_host(host)
    assert p.take_jobs() == [Write(1, "", [1], [0]), Store(op, [0], ["a" * 64], list(range(PS)), None), Free([0])]
    with pytest.raises(DoubleFree):
        p.free_host(host)
    assert p.take_jobs() == []                                              # a refused free records nothing


def test_several_ops_host_pages_freed_in_one_call_are_one_free_job_or_none():
    """``free_host`` of a list (the manager frees a progress check's finished storage ops so): one
    ``Free`` of every tensor's pages, in order; a list with one tensor already freed frees none."""
    p = ProxyOffloader(PS, host_pages=4, device_slots=16 * PS)
    a, b, c = (p.write(_slots([block]), ack_id=block) for block in (1, 2, 3))
    p.take_jobs()
    p.free_host([b, a])
    assert p.take_jobs() == [Free([1, 0])]
    with pytest.raises(DoubleFree):
        p.free_host([c, a])
    assert p.take_jobs() == []                                              # c's page was not freed either
    p.free_host([c])
    assert p.take_jobs() == [Free([2])]

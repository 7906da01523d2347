"""With a TP group, completions are settled as the prefix, in issue order, that has completed.

A one-rank gloo group in this process (MIN over one rank is the rank's own count), so the prefix
rule itself is visible without child processes: a later copy that landed first waits for the
earlier one; storage ops likewise. ``tests/lifecycle/test_tp.py`` checks agreement across ranks.
"""

from __future__ import annotations

from lifecycle import State
from tests.support.ranks import world  # noqa: F401 (fixture)
from tests.support.real_rig import Rig

PS = 4


def test_a_later_copy_waits_for_the_earlier_one_then_both_settle_in_order(world):
    rig = Rig(PS, tp_group=world)
    req, _ = rig.admit("t", 8, 24)
    rig.decode(req, 12)                               # acks 1, 2, 3
    rig.off.land([3, 2])
    rig.progress()
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage) == (0, 3, 0)
    rig.off.land([1])
    rig.progress()
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage) == (3, 0, 3)
    assert sorted(rig.off.pending_storage) == [1, 2, 3]
    assert rig.mgr.state_of(req) is State.PREFILLED


def test_storage_ops_settle_as_a_prefix_too(world):
    rig = Rig(PS, tp_group=world)
    req, _ = rig.admit("u", 8, 16)
    rig.decode(req, 8)                                # acks 1, 2
    rig.off.land()
    rig.progress()                                    # ops 1, 2
    rig.off.complete_storage([2])
    rig.progress()
    assert rig.mgr.stats().storage_finished == 0 and rig.off.host_free_pages() == 254
    rig.off.complete_storage([1])
    rig.progress()
    assert rig.mgr.stats().storage_finished == 2 and rig.off.host_free_pages() == 256


def test_without_a_group_whatever_completed_settles_at_once():
    """Ack 2 landed before ack 1 (another request's): settled at once, no prefix wait. (Within one
    request a chunk waits for its predecessor: chain order, tests/lifecycle/test_settle_edges.py.)"""
    rig = Rig(PS)
    v, _ = rig.admit("v", 8, 16)
    w, _ = rig.admit("w", 8, 16)
    rig.decode(v, 4)
    rig.decode(w, 4)
    rig.off.land([2])
    rig.progress()
    assert rig.mgr.stats().chunks_landed == 1


def test_ranks_settle_only_what_every_rank_of_their_tp_group_has_seen(world, monkeypatch):
    """A stand-in second rank: the reduction over the manager's TP group also sees a peer's counts
    (MIN: only what both ranks saw completes here); a rank outside the group (the default group)
    has seen nothing, so reducing over the wrong group, or with the wrong op, settles the wrong count."""
    import torch
    import torch.distributed as dist

    tp = dist.new_group([0])
    peer = {"tp": torch.tensor([2, 0]), "other": torch.tensor([0, 0])}
    real, calls = dist.all_reduce, []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)                  # this rank's part (one-rank group)
        calls.append((group is tp, op == dist.ReduceOp.MIN, tensor.dtype))
        other = peer["tp"] if group is tp else peer["other"]
        tensor.copy_(torch.minimum(tensor, other) if op == dist.ReduceOp.MIN else tensor + other)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    rig = Rig(PS, tp_group=tp)
    req, _ = rig.admit("p", 8, 24)
    rig.decode(req, 12)                                   # acks 1, 2, 3
    rig.off.land()
    rig.progress()                                        # here 3 landed, the peer saw 2
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage) == (2, 1, 2)
    assert calls == [(True, True, torch.int64)]
    peer["tp"] = torch.tensor([1, 5])
    rig.progress()                                        # ack 3 seen by both; no op done here yet
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage, s.storage_finished) == (3, 0, 3, 0)
    peer["tp"] = torch.tensor([0, 2])
    rig.off.complete_storage()
    rig.progress()                                        # 3 ops done here, 2 on the peer
    s = rig.mgr.stats()
    assert (s.storage_finished, s.inflight_storage) == (2, 1)
    peer["tp"] = torch.tensor([0, 3])
    rig.progress()
    assert rig.mgr.stats().storage_finished == 3 and rig.mgr.idle()
    assert rig.mgr.state_of(req) is State.PREFILLED and len(calls) == 4


def test_a_forced_shutdown_drains_in_step_with_the_group(world, monkeypatch):
    """Every rank runs the same number of progress checks: this rank is idle after its second (the
    copy lands, then its storage write), but a stand-in peer reports busy for three rounds (MAX over
    the group), so it checks four times."""
    import torch
    import torch.distributed as dist

    real, rounds = dist.all_reduce, []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)
        if op == dist.ReduceOp.MAX:                       # the drain's (busy, expired) agreement
            rounds.append(tensor.tolist())
            tensor.copy_(torch.maximum(tensor, torch.tensor([int(len(rounds) < 4), 0])))
        else:
            tensor.copy_(torch.minimum(tensor, tensor))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    rig = Rig(PS, tp_group=world)
    req, _ = rig.admit("d", 8, 16)
    rig.decode(req, 4)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    rig.off.auto_land = True                              # lands (and stores) when polled
    pending = rig.mgr.shutdown(force=True, timeout_s=5.0)
    assert rounds == [[1, 0], [0, 0], [0, 0], [0, 0]]     # this rank's own (busy, expired) each round
    assert (pending.copies, pending.storage_ops, rig.mgr.stats().abandoned) == (0, 0, 0)
    assert rig.mgr.state_of(req) is State.RELEASED and rig.mgr.closed

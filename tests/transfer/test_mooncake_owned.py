"""``transfer/storage/mooncake_owned.py`` against a real ``mooncake_master``: a Mooncake store only
deletes what it wrote and can prove it wrote, and gets an evicted seal back.

Written from docs/storage.md (the file store never touches another deployment's files; the Mooncake
tier must not either) and from strict mode's promise (a page of ours is found again once written).
A raw client plays SGLang (and Mooncake's eviction: ``remove`` of single objects).
"""

from __future__ import annotations

import torch

from lifecycle_tools.testkit.mooncake_server import mooncake_master, mooncake_session_master  # noqa: F401
from tests.transfer.test_mooncake_storage import (  # noqa: F401 (fixtures)
    MHA, NB, Counted, _replace, fresh_hashes, module_master, pages, raw, sglang_keys, shared_store, store,
)
from transfer import open_storage
from transfer.storage.identity import DeploymentIdentity

SUFFIX = "_org-tiny_1_2"
TINY = DeploymentIdentity(model_name="org/tiny", tp_rank=1, tp_size=2)  # its file suffix is SUFFIX


def objects(h: str) -> list[str]:
    """SGLang's K and V names of page ``h`` for tp rank 1, then our seal's."""
    return sglang_keys(h, "org/tiny", 1, mla=False) + [f"org-tiny_{h}_1_kvlp"]


def read_raw(raw, name: str) -> torch.Tensor:
    size = raw.get_size(name)
    out = torch.zeros(size, dtype=torch.uint8)
    raw.register_buffer(out.data_ptr(), size)
    try:
        assert raw.batch_get_into([name], [out.data_ptr()], [size]) == [size]
    finally:
        raw.unregister_buffer(out.data_ptr())
    return out


def test_a_stale_seal_never_deletes_another_writers_page(store, raw):
    """Our K/V evicted, our seal left; SGLang then writes the same page name with its own bytes.
    Our read misses (the bytes fail our seal) and SGLang's objects stay readable."""
    h = fresh_hashes(1)[0]
    ours, theirs = pages(2, seed=11)
    assert store.batch_set([h], [ours]) == [True]
    k_name, v_name, _ = objects(h)
    for name, half in ((k_name, theirs[:NB // 2]), (v_name, theirs[NB // 2:])):  # evicted, then SGLang's
        _replace(raw, name, half.clone())
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [False] and not buf.any() and store.stats().corrupt == 1
    assert raw.batch_is_exist(objects(h)) == [1, 1, 1]
    assert torch.equal(torch.cat([read_raw(raw, k_name), read_raw(raw, v_name)]), theirs)  # SGLang reads its page


def test_a_failed_seal_write_removes_only_the_objects_it_created(store, raw, monkeypatch):
    """A page write whose seal put fails removes what that put created, never an object that was
    already there (SGLang's K here)."""
    from transfer.storage import mooncake_conn as conn

    h = fresh_hashes(1)[0]
    ours, theirs = pages(2, seed=12)
    k_name, v_name, seal_name = objects(h)
    _replace(raw, k_name, theirs[:NB // 2].clone())  # SGLang's K only (its V was evicted)
    tier = store._store  # the MooncakeStorage under the counting wrapper

    class NoRoomForSeals:
        """The real client, except that a seal object finds no room (Mooncake's NO_AVAILABLE_HANDLE)."""

        def __init__(self, client):
            self._client = client

        def batch_put_from(self, names, ptrs, sizes, config):
            codes = self._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config)
            return codes + [conn.NO_SPACE]

        def __getattr__(self, name):
            return getattr(self._client, name)

    monkeypatch.setattr(tier, "_store", NoRoomForSeals(tier._store))
    assert store.batch_set([h], [ours]) == [False]
    monkeypatch.undo()
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [1, 0, 0]  # our V removed, SGLang's K kept
    assert torch.equal(read_raw(raw, k_name), theirs[:NB // 2])


def test_objects_a_failed_seal_write_created_are_removed_even_while_a_reader_holds_them(store, raw, monkeypatch):
    """Between our put and its rollback a reader (SGLang on another node) reads the new K and V,
    which gives them a lease (Mooncake then refuses a plain ``remove`` with OBJECT_HAS_LEASE). The
    rollback still removes them: no page of ours stays without its seal."""
    from transfer.storage import mooncake_conn as conn

    h = fresh_hashes(1)[0]
    ours = pages(1, seed=16)[0]
    k_name, v_name, seal_name = objects(h)
    tier = store._store

    class ReadBeforeRollback:
        """The real client; a seal finds no room, and the page objects are read right after the put."""

        def __init__(self, client):
            self._client = client

        def batch_put_from(self, names, ptrs, sizes, config):
            codes = self._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config)
            assert codes == [conn.OK, conn.OK]
            for name in (k_name, v_name):
                read_raw(raw, name)  # leased now
            return codes + [conn.NO_SPACE]

        def __getattr__(self, name):
            return getattr(self._client, name)

    monkeypatch.setattr(tier, "_store", ReadBeforeRollback(tier._store))
    assert store.batch_set([h], [ours]) == [False]
    monkeypatch.undo()
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [0, 0, 0]


def test_remove_created_counts_the_objects_it_removed():
    """``_remove_created`` removes only what the put stored and did not exist before, and returns
    how many removals succeeded (a removal the store refuses is not counted)."""
    from transfer.storage import mooncake_conn as conn
    from transfer.storage.mooncake_owned import MooncakeOwnership

    class Store:
        def __init__(self, refused):
            self.refused, self.removed = refused, []

        def remove(self, name, force=False):
            if name in self.refused:
                return -706
            self.removed.append(name)
            return 0

    names = ["a", "b", "c", "d", "e", "f"]
    codes = [conn.OK, conn.OK, conn.NO_SPACE, conn.OK, conn.OK, conn.OK]
    existed = [False, True, False, False, False, False]
    s = Store(refused={"f"})
    assert MooncakeOwnership()._remove_created(s, names, codes, existed) == 3
    assert s.removed == ["a", "d", "e"]
    assert MooncakeOwnership()._remove_created(Store(refused=set()), names[:2], codes[:2], existed[:2]) == 1
    assert MooncakeOwnership()._remove_created(Store(refused={"a"}), ["a"], [conn.OK], [False]) == 0


def test_strict_mode_finds_a_page_again_once_batch_set_restores_its_evicted_seal(store, raw, module_master):
    h = fresh_hashes(1)[0]
    page = pages(1, seed=13)[0]
    strict = Counted(open_storage(module_master.spec(require_checksum=1, global_segment_size=0),
                                  page_nbytes=NB, identity=TINY, page_format=MHA))
    try:
        assert store.batch_set([h], [page]) == [True] and strict.batch_exists([h]) == 1
        assert raw.remove(objects(h)[2], True) == 0  # Mooncake evicted the seal object only
        buf = torch.zeros(NB, dtype=torch.uint8)
        assert strict.batch_exists([h]) == 0 and strict.batch_get([h], [buf]) == [False]
        assert strict.batch_set([h], [page]) == [True]
        assert strict.batch_exists([h]) == 1 and strict.batch_get([h], [buf]) == [True] and torch.equal(buf, page)
        assert strict.stats().resealed == 1
        assert store.batch_set([h], [page]) == [True] and store.stats().skipped == 1  # sealed again: skipped
    finally:
        strict.close()


def test_an_unsealed_page_with_other_bytes_is_not_sealed_as_ours(store, raw):
    """K/V present without a seal but holding other bytes (SGLang's page): ``batch_set`` must not
    seal them with our digest nor touch them; the page is reported not stored."""
    h = fresh_hashes(1)[0]
    ours, theirs = pages(2, seed=14)
    k_name, v_name, seal_name = objects(h)
    for name, half in ((k_name, theirs[:NB // 2]), (v_name, theirs[NB // 2:])):
        _replace(raw, name, half.clone())
    assert store.batch_set([h], [ours]) == [False]
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [1, 1, 0] and store.stats().foreign == 1
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [True] and torch.equal(buf, theirs)  # SGLang's page, unverified
    assert store.stats().unverified == 1


def test_an_unsealed_page_with_our_exact_bytes_written_by_sglang_is_sealed(store, raw):
    h = fresh_hashes(1)[0]
    page = pages(1, seed=15)[0]
    k_name, v_name, seal_name = objects(h)
    for name, half in ((k_name, page[:NB // 2]), (v_name, page[NB // 2:])):
        _replace(raw, name, half.clone())
    assert store.batch_set([h], [page]) == [True] and raw.batch_is_exist([seal_name]) == [1]
    assert store.stats().resealed == 1
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [True] and store.stats().unverified == 0

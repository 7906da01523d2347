"""``transfer/storage/mooncake/owned.py`` against a real ``mooncake_master``: a Mooncake store only
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


class Wrapped:
    """The real client with some calls replaced (set as attributes, or overridden in a subclass)."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)


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
    from transfer.storage.mooncake import conn

    h = fresh_hashes(1)[0]
    ours, theirs = pages(2, seed=12)
    k_name, v_name, seal_name = objects(h)
    _replace(raw, k_name, theirs[:NB // 2].clone())  # SGLang's K only (its V was evicted)
    tier = store._store  # the MooncakeStorage under the counting wrapper

    class NoRoomForSeals(Wrapped):
        """The real client, except that a seal object finds no room (Mooncake's NO_AVAILABLE_HANDLE)."""

        def batch_put_from(self, names, ptrs, sizes, config):
            codes = self._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config)
            return codes + [conn.NO_SPACE]

    monkeypatch.setattr(tier, "_store", NoRoomForSeals(tier._store))
    assert store.batch_set([h], [ours]) == [False]
    monkeypatch.undo()
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [1, 0, 0]  # our V removed, SGLang's K kept
    assert torch.equal(read_raw(raw, k_name), theirs[:NB // 2])


def test_a_page_whose_k_write_failed_but_whose_seal_was_stored_misses_until_the_next_write_completes_it(
        store, raw, monkeypatch):
    """The seal put succeeds while the K put finds no room: nothing is removed (the seal covers
    this page's name and bytes, so it is not wrong, only early). Reads miss (K is missing); the next
    ``batch_set`` of the page stores K, keeps V and the seal (Mooncake keeps an existing object)
    and the page is served, byte-exact."""
    from transfer.storage.mooncake import conn

    h = fresh_hashes(1)[0]
    ours = pages(1, seed=17)[0]
    k_name, v_name, seal_name = objects(h)
    tier = store._store

    class NoRoomForK(Wrapped):
        """The real client, except that the page's K object finds no room."""

        def batch_put_from(self, names, ptrs, sizes, config):
            assert names[0] == k_name
            return [conn.NO_SPACE] + self._client.batch_put_from(names[1:], ptrs[1:], sizes[1:], config)

    monkeypatch.setattr(tier, "_store", NoRoomForK(tier._store))
    assert store.batch_set([h], [ours]) == [False]
    monkeypatch.undo()
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [0, 1, 1]
    buf = torch.zeros(NB, dtype=torch.uint8)
    assert store.batch_get([h], [buf]) == [False] and not buf.any()
    assert store.batch_set([h], [ours]) == [True]
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [1, 1, 1]
    assert store.batch_get([h], [buf]) == [True] and torch.equal(buf, ours)
    assert store.stats().corrupt == 0


def test_objects_a_failed_seal_write_created_are_removed_even_while_a_reader_holds_them(store, raw, monkeypatch):
    """Between our put and its rollback a reader (SGLang on another node) reads the new K and V,
    which gives them a lease (Mooncake then refuses a plain ``remove`` with OBJECT_HAS_LEASE). The
    rollback still removes them: no page of ours stays without its seal."""
    from transfer.storage.mooncake import conn

    h = fresh_hashes(1)[0]
    ours = pages(1, seed=16)[0]
    k_name, v_name, seal_name = objects(h)
    tier = store._store

    class ReadBeforeRollback(Wrapped):
        """The real client; a seal finds no room, and the page objects are read right after the put."""

        def batch_put_from(self, names, ptrs, sizes, config):
            codes = self._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config)
            assert codes == [conn.OK, conn.OK]
            for name in (k_name, v_name):
                read_raw(raw, name)  # leased now
            return codes + [conn.NO_SPACE]

    monkeypatch.setattr(tier, "_store", ReadBeforeRollback(tier._store))
    assert store.batch_set([h], [ours]) == [False]
    monkeypatch.undo()
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [0, 0, 0]


def test_remove_created_counts_the_objects_it_removed():
    """``_remove_created`` removes only what the put stored and did not exist before, and returns
    how many removals succeeded (a removal the store refuses is not counted)."""
    from transfer.storage.mooncake import conn
    from transfer.storage.mooncake.owned import MooncakeOwnership

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
    seal them with our digest nor touch them; the page is already there (SGLang's own rule):
    reported stored, counted ``foreign_kept``."""
    h = fresh_hashes(1)[0]
    ours, theirs = pages(2, seed=14)
    k_name, v_name, seal_name = objects(h)
    for name, half in ((k_name, theirs[:NB // 2]), (v_name, theirs[NB // 2:])):
        _replace(raw, name, half.clone())
    assert store.batch_set([h], [ours]) == [True]
    assert raw.batch_is_exist([k_name, v_name, seal_name]) == [1, 1, 0]
    assert (store.stats().foreign_kept, store.stats().foreign, store.stats().stored) == (1, 0, 0)
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


# --- reseal: several pages in one batch, failures, and the master going away ----------------------

from structlog.testing import capture_logs  # noqa: E402
import pytest  # noqa: E402

from transfer.errors import StorageUnavailable  # noqa: E402
from transfer.storage.mooncake import conn  # noqa: E402
from tests.transfer.test_mooncake_storage import _replace as put_raw  # noqa: E402


def sglang_writes(raw, h: str, page: torch.Tensor) -> None:
    """SGLang stores page ``h`` (its K and V objects, no seal of ours)."""
    k_name, v_name, _ = objects(h)
    put_raw(raw, k_name, page[:NB // 2].clone())
    put_raw(raw, v_name, page[NB // 2:].clone())


def events(logs, name: str) -> list[dict]:
    return [e for e in logs if e.get("event") == name]


def test_a_batch_reseals_each_page_on_its_own_objects(store, raw):
    """Three pages found without a seal in one ``batch_set``: the first and last hold our exact
    bytes (sealed again), the middle one a K object of another size (SGLang's, another page
    size): that one alone is left alone — already there (True, ``foreign_kept``), logged at
    debug only: never a warning."""
    hs = fresh_hashes(3)
    pool = pages(3, seed=17)
    for h, page in zip(hs, pool):
        sglang_writes(raw, h, page)
    k1 = objects(hs[1])[0]
    put_raw(raw, k1, torch.cat([pool[1][:NB // 2], pool[1][:NB // 2]]))  # twice the size we expect
    with capture_logs() as logs:
        assert store.batch_set(hs, list(pool)) == [True, True, True]
    assert raw.batch_is_exist([objects(h)[2] for h in hs]) == [1, 0, 1]
    assert raw.get_size(k1) == NB and raw.batch_is_exist(objects(hs[1])[:2]) == [1, 1]  # untouched
    stats = store.stats()
    assert (stats.resealed, stats.foreign_kept, stats.foreign, stats.errors) == (2, 1, 0, 0)
    assert not [e for e in logs if e.get("log_level") in ("warning", "error", "critical")]
    assert [e["name"] for e in events(logs, "mooncake.not_ours") if e["log_level"] == "debug"] in (
        [], [f"org-tiny_{hs[1]}_1"])  # debug lines reach the capture only when debug is enabled
    out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(3)]
    assert store.batch_get(hs, out) == [True, False, True]
    assert torch.equal(out[0], pool[0]) and torch.equal(out[2], pool[2]) and store.stats().unverified == 0


def test_a_seal_that_finds_no_room_on_reseal_is_a_counted_logged_failure(store, raw, monkeypatch):
    """Three pages of our exact bytes without a seal: each is read back on its own, and the seals
    are put in one batch; the last finds the segment full: that page alone is not stored,
    counted in ``errors`` and logged by its seal object's name and Mooncake's code."""
    hs = fresh_hashes(3)
    pool = pages(3, seed=18)
    for h, page in zip(hs, pool):
        sglang_writes(raw, h, page)
    tier = store._store
    client = Wrapped(tier._store)
    seals = [objects(h)[2] for h in hs]

    def batch_put_from(names, ptrs, sizes, config):  # the last seal finds the segment full
        assert names == seals
        return client._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config) + [conn.NO_SPACE]

    client.batch_put_from = batch_put_from
    monkeypatch.setattr(tier, "_store", client)
    with capture_logs() as logs:
        assert store.batch_set(hs, list(pool)) == [True, True, False]
    monkeypatch.undo()
    assert raw.batch_is_exist(seals) == [1, 1, 0]
    stats = store.stats()
    assert (stats.resealed, stats.errors, stats.foreign) == (2, 1, 0)
    assert [{k: e.get(k) for k in ("event", "log_level", "name", "code")} for e in events(logs, "mooncake.write_failed")] == [
        {"event": "mooncake.write_failed", "log_level": "error", "name": seals[2], "code": "NO_AVAILABLE_HANDLE(-200)"}]


@pytest.fixture
def own_store(module_master, shared_store):
    """A store of its own (the test opens its breaker), placing objects on the module store's segment."""
    s = Counted(open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB, identity=TINY, page_format=MHA))
    yield s
    s.close()


def _unreachable_reseal(own_store, raw, monkeypatch, call: str):
    """A page to reseal, and the master gone at ``call`` (every code RPC_FAIL): batch_set raises
    StorageUnavailable, as it does when the master is gone at the existence check or the put."""
    h = fresh_hashes(1)[0]
    page = pages(1, seed=19)[0]
    sglang_writes(raw, h, page)
    tier = own_store._store
    client = Wrapped(tier._store)
    setattr(client, call, lambda names, *rest: [-900] * len(names))
    monkeypatch.setattr(tier, "_store", client)
    with capture_logs() as logs, pytest.raises(StorageUnavailable, match="unreachable"):
        own_store.batch_set([h], [page])
    monkeypatch.undo()
    assert raw.batch_is_exist(objects(h)) == [1, 1, 0]
    stats = own_store.stats()
    assert (stats.foreign, stats.resealed, stats.errors) == (0, 0, 1)
    assert not events(logs, "mooncake.not_ours") and not events(logs, "mooncake.write_failed")
    return [e["error"] for e in events(logs, "storage.tier_down")]


def test_a_master_gone_at_the_reseal_read_is_an_outage_not_a_foreign_page(own_store, raw, monkeypatch):
    """Not being able to read the objects back proves nothing about whose they are: no
    ``foreign`` count, no "not ours" warning; the breaker opens, naming the step."""
    assert _unreachable_reseal(own_store, raw, monkeypatch, "batch_get_into") == ["read before reseal: RPC_FAIL(-900)"]


def test_a_master_gone_at_the_reseal_put_is_an_outage_not_a_page_write_failure(own_store, raw, monkeypatch):
    assert _unreachable_reseal(own_store, raw, monkeypatch, "batch_put_from") == ["reseal: RPC_FAIL(-900)"]


def test_a_restored_seal_is_placed_as_configured(module_master, shared_store, raw):
    """The seal ``batch_set`` puts back follows the store's put configuration, like every object
    it writes: ``replica_num=2`` (two segments here: the module store's and this store's) gives
    the seal two replicas."""
    s = open_storage(module_master.spec(replica_num=2, global_segment_size=16 << 20), page_nbytes=NB, identity=TINY,
                     page_format=MHA)
    try:
        h = fresh_hashes(1)[0]
        page = pages(1, seed=20)[0]
        sglang_writes(raw, h, page)
        assert s.batch_set([h], [page]) == [True] and s.stats().resealed == 1
        assert len(raw.get_replica_desc(objects(h)[2])) == 2
    finally:
        s.close(wait=True)


def test_only_the_page_whose_seal_failed_is_rolled_back_in_a_batch(store, raw, monkeypatch):
    """Two new pages in one write; the second page's seal finds no room: that page's objects are
    removed again, the first page stays whole."""
    hs = fresh_hashes(2)
    pool = pages(2, seed=21)
    tier = store._store
    client = Wrapped(tier._store)

    def batch_put_from(names, ptrs, sizes, config):
        assert names == objects(hs[0]) + objects(hs[1])
        return client._client.batch_put_from(names[:-1], ptrs[:-1], sizes[:-1], config) + [conn.NO_SPACE]

    client.batch_put_from = batch_put_from
    monkeypatch.setattr(tier, "_store", client)
    assert store.batch_set(hs, list(pool)) == [True, False]
    monkeypatch.undo()
    assert raw.batch_is_exist(objects(hs[0]) + objects(hs[1])) == [1, 1, 1, 0, 0, 0]


# --- another deployment's pages (issue 35: the ownership rule, and "already there") ---------------

from tests.support.transfer_helpers import drain  # noqa: E402
from tests.transfer.test_mooncake_storage import DIM, HEADS, LAYERS, MHA as HOST_FORMAT, PS  # noqa: E402
from transfer import build_stack  # noqa: E402
from transfer.storage.mooncake.keys import MooncakeNaming  # noqa: E402


def test_two_deployments_of_other_host_layouts_never_destroy_each_others_pages(module_master, shared_store, raw):
    """Same object names (as SGLang's), another host layout: each deployment reads every page of
    its own; the other's are ``foreign`` misses; a delete of a name the other holds removes
    nothing, and a write of a name whose seal is the other's, one of its objects evicted, adds
    nothing to it (both counted ``foreign_kept``). Before, ``delete`` removed the other's page
    and such a write put our K next to its V and seal (a page neither could read again)."""
    ident = DeploymentIdentity(model_name="org/layouts")
    naming = MooncakeNaming.of(ident)

    def deployment(layout: str):
        return open_storage(module_master.spec(global_segment_size=0), page_nbytes=NB,
                            identity=ident.replace(layout=layout), page_format=HOST_FORMAT)

    def reads(store, layout: str, idx) -> list[bool]:
        into = [torch.zeros(NB, dtype=torch.uint8) for _ in idx]
        got = store.batch_get([hs[i] for i in idx], into)
        for ok, buf, i in zip(got, into, idx):
            assert torch.equal(buf, mine[layout][i]) if ok else not buf.any()
        return got

    head, first = deployment("page_head"), deployment("page_first")
    try:
        hs = fresh_hashes(6)
        mine = {"page_head": pages(6, seed=31), "page_first": pages(6, seed=32)}
        assert head.batch_set(hs[:4], list(mine["page_head"][:4])) == [True] * 4
        assert first.batch_set(hs[2:], list(mine["page_first"][2:])) == [True] * 4  # hs[2:4]: theirs, kept
        assert reads(head, "page_head", range(4)) == [True] * 4
        assert reads(first, "page_first", range(2, 6)) == [False, False, True, True] and first.stats().foreign == 2
        assert first.delete(hs[2]) is False and first.stats().foreign_kept == 1
        assert raw.batch_is_exist(naming.objects(hs[2]) + [naming.seal_object(hs[2])]) == [1, 1, 1]
        k3 = naming.objects(hs[3])[0]
        assert raw.remove(k3, True) == 0  # Mooncake evicted page_head's K of hs[3]
        assert first.batch_set([hs[3]], [mine["page_first"][3]]) == [True] and first.stats().foreign_kept == 2
        assert raw.batch_is_exist([k3]) == [0]  # nothing of page_first's added to page_head's page
        assert head.batch_set([hs[3]], [mine["page_head"][3]]) == [True]  # its writer puts its K back
        assert reads(head, "page_head", range(4)) == [True] * 4
        assert head.delete(hs[3]) is True  # its own page: deleted
    finally:
        head.close(), first.close()


def test_a_page_sglang_stored_first_with_other_bytes_is_already_there_not_a_failed_write(module_master, raw):
    """A mixed fleet: SGLang stored a page first with other numerics (same tokens, other bytes, no
    seal of ours). Our offloader's write of that page is not a failure: no ``storage_failed``, no
    warning or error logged; the tier counts it ``foreign_kept`` (already there, as SGLang counts
    an existing key) and SGLang's objects stay as they are."""
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 16, 16, 1, 16, storage=module_master.spec(),
                        model_name="org/mixed")
    try:
        naming = MooncakeNaming.of(stack.identity)
        hs = fresh_hashes(2)
        ours, theirs = pages(2, seed=41), pages(1, seed=42)[0]
        k_name, v_name = naming.objects(hs[0])
        put_raw(raw, k_name, theirs[:NB // 2].clone())  # SGLang's page hs[0], its own bytes
        put_raw(raw, v_name, theirs[NB // 2:].clone())
        host = stack.host_pool
        held = host.alloc(2 * PS)
        for p, row in zip(host.page_ids(held).tolist(), ours):
            host.page_bytes(p).copy_(row)
        off = stack.offloader
        with capture_logs() as logs:
            op = off.write_storage(held, list(range(2 * PS)), hs)
            assert drain(off.finished_storage, 1, timeout=60) == [op]
        assert off.failed_storage() == []
        st, tier = off.stats(), stack.storage.stats()
        assert (st.storage_ok, st.storage_failed) == (1, 0)
        assert (tier.foreign_kept, tier.stored, tier.errors, tier.foreign) == (1, 1, 0, 0)
        assert not [e for e in logs if e.get("log_level") in ("warning", "error", "critical")]
        assert torch.equal(read_raw(raw, k_name), theirs[:NB // 2])  # SGLang's objects, as they were
        assert torch.equal(read_raw(raw, v_name), theirs[NB // 2:])
        assert raw.batch_is_exist([naming.seal_object(hs[0]), naming.seal_object(hs[1])]) == [0, 1]
        off.free_host(held)
    finally:
        stack.close()

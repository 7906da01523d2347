"""Decode with real KV through the real pools, HostOffloader and FileStorage, driving the
Offloader protocol directly as the lifecycle manager would; then reuse a prefix bit-exact."""

from types import SimpleNamespace

import torch

import hashing
from transfer import FileStorage, HostOffloader, HostPool, KVPool, PagedTokenAllocator, PrefixLoader, ReqToTokenPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from tests.support.transfer_helpers import drain, polls

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8
SUFFIX = hashing.storage_suffix("org/tiny")


def page_first(kv_vals):
    """Device-order KV ``[kinds, layers, ps, heads, dim]`` -> page-first bytes."""
    return kv_vals.permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8).reshape(-1)


class Decoder:
    """A minimal decode loop: one slot per token, KV = synthetic_kv(request, position)."""

    def __init__(self, tmp_path):
        self.alloc = PagedTokenAllocator(256, PS)
        self.reqs = ReqToTokenPool(4, 64)
        self.kv = KVPool(LAYERS, HEADS, DIM, torch.bfloat16, self.alloc.total_slots)
        self.host = HostPool(LAYERS, HEADS, DIM, torch.bfloat16, PS, 64)
        self.store = FileStorage(tmp_path, SUFFIX, self.host.page_nbytes)
        self.off = HostOffloader(self.kv, self.host, self.store)
        self.free0 = self.alloc.available_size()

    def admit(self, rid, prompt):
        req = SimpleNamespace(rid=rid, prompt=prompt, output=[], kv=SimpleNamespace(req_pool_idx=self.reqs.alloc()),
                              slots=torch.empty(0, dtype=torch.int64), inc=0)
        p = len(prompt) // PS * PS
        req.tail = hashing.page_hashes(prompt[:p], PS)[-1] if p else None
        req.P = p
        return req

    def step(self, req, token):
        """Sample ``token``. The first step writes the prompt's KV; each later step writes the KV
        of the previously sampled token (the newest sampled token has no KV yet)."""
        pos = len(req.prompt) + len(req.output)  # tokens with KV after this step
        if pos > req.slots.numel():
            req.slots = torch.cat([req.slots, self.alloc.alloc(PS)])
        if not req.output:  # prefill KV for the prompt arrives with the first step
            need = len(req.prompt)
            while req.slots.numel() < need:
                req.slots = torch.cat([req.slots, self.alloc.alloc(PS)])
            self.kv.write(req.slots[:need], synthetic_kv(self.kv, req.rid, torch.arange(need)))
        else:
            self.kv.write(req.slots[pos - 1:pos], synthetic_kv(self.kv, req.rid, torch.tensor([pos - 1])))
        row = req.kv.req_pool_idx
        self.reqs.req_to_token[row, : req.slots.numel()] = req.slots.to(torch.int32)
        req.output.append(token)

    def kv_tokens(self, req):
        return req.prompt + req.output[:-1]

    def next_chunk(self, req):
        have = len(self.kv_tokens(req)) - req.P - req.inc
        n = have // PS * PS
        if n <= 0:
            return None
        start = req.P + req.inc
        req.inc += n
        return start, n


def test_decode_offload_store_and_reuse(tmp_path):
    d = Decoder(tmp_path)
    prompts = {1: list(range(1000, 1010)), 2: list(range(2000, 2007))}
    reqs = [d.admit(rid, p) for rid, p in prompts.items()]
    acks, pending = {}, {}
    stored = {}  # page hash -> expected bytes
    ack_ids = iter(range(1, 10_000))
    for step in range(13):
        for r in reqs:
            d.step(r, 50 + step)
            if not r.output[:-1] and r.P:  # stand in for the prefill node's backup of [0, P)
                start, n = 0, r.P
                toks = r.prompt[:n]
                hashes = hashing.page_hashes(toks, PS)
            elif (chunk := d.next_chunk(r)) is not None:
                start, n = chunk
                toks = d.kv_tokens(r)[start:start + n]
                hashes, r.tail = hashing.extend_chain(r.tail, toks, PS)
            else:
                continue
            ack = next(ack_ids)
            host = d.off.write(r.slots[start:start + n], ack)
            assert host is not None
            acks[ack] = (r, host, toks, hashes)
            for i, h in enumerate(hashes):
                stored[h] = page_first(d.kv.read(r.slots[start + i * PS:start + (i + 1) * PS]))
        for ack in polls(d.off).ended():
            r, host, toks, hashes = acks.pop(ack)
            pending[d.off.write_storage(host, toks, hashes)] = host
        for op in d.off.finished_storage():
            d.off.free_host(pending.pop(op))
    for ack in drain(polls(d.off).ended, len(acks)):
        r, host, toks, hashes = acks.pop(ack)
        pending[d.off.write_storage(host, toks, hashes)] = host
    for op in drain(d.off.finished_storage, len(pending)):
        d.off.free_host(pending.pop(op))
    assert d.off.idle() and d.off.stats().storage_failed == 0

    # every stored page reads back equal to the device KV it came from
    assert len(stored) >= 4
    for h, want in stored.items():
        buf = torch.empty(d.host.page_nbytes, dtype=torch.uint8)
        assert d.store.batch_get([h], [buf]) == [True]
        assert torch.equal(buf, want)
        assert (tmp_path / f"{h}{SUFFIX}.bin").stat().st_size == d.host.page_nbytes

    # release everything the requests hold: each page once, each row once
    first = reqs[0]
    history = first.prompt + first.output
    for r in reqs:
        d.alloc.free(r.slots)
        d.reqs.free(r)
    assert d.alloc.available_size() == d.free0 and d.reqs.available_size() == 4
    d.alloc.check_integrity()

    # a second request sharing request 1's history gets its KV back, bit-exact
    loader = PrefixLoader(d.kv, d.alloc, d.host, d.store)
    follow_up = history + [9, 9, 9]
    n_pages = loader.start(77, follow_up)
    assert n_pages == len(d.kv_tokens(first)) // PS
    (done,) = drain(loader.finished, 1)
    assert done.pages == n_pages and done.error is None
    want = synthetic_kv(d.kv, first.rid, torch.arange(n_pages * PS))
    assert torch.equal(d.kv.read(done.device_indices).view(torch.uint8), want.view(torch.uint8))
    d.alloc.free(done.device_indices)
    assert d.alloc.available_size() == d.free0 and d.host.available_size() == 64
    d.alloc.check_integrity()
    d.host.check_integrity()
    d.off.close()
    loader.close()

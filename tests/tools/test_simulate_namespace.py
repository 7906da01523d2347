"""``kv-lifecycle simulate --lora-adapters N --cache-salts M``: chats served by LoRA adapters and
salted tenants share token prefixes (the system prompt, the same seed's tokens) but never pages.

The synthetic KV of a namespace differs from every other's for the same tokens, so a page found
or stored across namespaces is a mismatch the run reports; the file tier's names are checked
against each request's own chain.
"""

from __future__ import annotations

import os

import hashing
from lifecycle_tools.simulate import SimConfig, kv_ids, make_workload
from lifecycle_tools.simulate.workload import all_plans
from tests.tools.test_simulate import check_pass, simulate


def test_namespaces_leave_the_tokens_of_the_seed_and_a_chat_keeps_its_namespace():
    plain = list(all_plans(make_workload(SimConfig(requests=60, turns=3, seed=4))))
    spaced = list(all_plans(make_workload(SimConfig(requests=60, turns=3, seed=4, lora_adapters=2,
                                                    cache_salts=2))))
    assert [(p.rid, p.prompt, p.output, p.arrival) for p in plain] == \
        [(p.rid, p.prompt, p.output, p.arrival) for p in spaced]
    assert all(p.extra_key is None and p.cache_salt is None for p in plain)
    assert {p.extra_key for p in spaced} == {None, "lora-1", "lora-2"}
    assert {p.cache_salt for p in spaced} == {None, "tenant-1", "tenant-2"}
    for p in spaced:
        if p.next is not None:
            assert (p.next.extra_key, p.next.cache_salt) == (p.extra_key, p.cache_salt)


def test_kv_ids_of_a_namespace_differ_at_every_position_and_the_base_models_are_unchanged():
    tokens = list(range(50))
    h, base = 1_234_567, []
    for t in tokens:                            # the digest as it was before namespaces
        h = (h * 1_000_033 + t + 1) % 2_147_483_647
        base.append(h)
    assert kv_ids(tokens) == kv_ids(tokens, None) == base
    for ns in (hashing.namespace_seed("lora-1"), hashing.namespace_seed(None, "tenant-1")):
        assert all(a != b for a, b in zip(kv_ids(tokens, ns), base))


def test_a_run_with_adapters_and_salts_stores_each_namespace_under_its_own_names(tmp_path):
    proc, report = simulate(tmp_path, "--requests", "24", "--lora-adapters", "2", "--cache-salts", "1", "--warm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cold, warm = report["passes"]
    for p in (cold, warm):
        check_pass(p)                           # no prefix mismatch, every sampled page verified
    assert warm["prefix_hit_rate"] > 0.9        # each namespace finds its own pages again
    # every page in the tier is a page of some request's chain in that request's own namespace
    cfg = SimConfig(**report["config"])         # the run's own configuration: the same workload
    by_space: dict[tuple, set[str]] = {}
    for plan in all_plans(make_workload(cfg)):
        tokens = plan.prompt + plan.output[:-1]
        seed = hashing.namespace_seed(plan.extra_key, plan.cache_salt)
        names = hashing.page_hashes(tokens, cfg.page_size, seed)
        by_space.setdefault((plan.extra_key, plan.cache_salt), set()).update(names)
    assert len(by_space) == 5                   # base, lora-1, tenant-1, lora-2 + tenant-1, lora-1 + tenant-1
    stored = {n[:64] for n in os.listdir(tmp_path / "store") if n.endswith(".bin")}
    assert stored and stored <= set().union(*by_space.values())
    for space, names in by_space.items():
        assert stored & names, f"namespace {space} stored nothing"

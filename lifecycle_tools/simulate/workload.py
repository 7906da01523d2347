"""The synthetic workload: chats of one or more turns, a pure function of the seed, made lazily.

A chat arrives at a step (Poisson arrivals counted in scheduler steps); its turn ``t`` is a request
whose prompt is the system prompt, every earlier turn's prompt and output, and new user tokens, so
later turns (and other chats, through the system prompt) share prefixes. ``iter_chats`` yields the
chats in arrival order, one at a time: memory holds only the chats the scheduler has taken.

With ``lora_adapters`` / ``cache_salts`` each chat is served by a LoRA adapter (SGLang appends its
id to ``Req.extra_key``) and/or belongs to a salted tenant, drawn from a generator of its own so the
tokens are those of the same seed without them; every turn of a chat keeps the chat's namespace.
Requests of different namespaces then share token prefixes (the system prompt), but never pages.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from lifecycle_tools.simulate.dist import parse_dist

VOCAB = 32_000
_KVID_MOD = 2_147_483_647
_KVID_MUL = 1_000_033
_KVID_SEED = 1_234_567


@dataclass
class Plan:
    """One request of the workload: a turn of a chat. Pure data, a function of the seed."""

    rid: str
    conv: int
    turn: int
    prompt: list[int]
    output: list[int]              # the tokens it will sample (all of them; fewer if aborted)
    arrival: int                   # step (turn 0); later turns arrive think_steps after the previous
    abort_at: int | None = None    # aborted once it holds this many output tokens
    retract_at: int | None = None  # retracted (once) at this many output tokens
    next: "Plan | None" = None
    extra_key: str | None = None   # SGLang's Req.extra_key: the LoRA adapter's id (None: the base model)
    cache_salt: str | None = None  # the tenant's cache salt (None: unsalted)

    @property
    def max_slots(self) -> int:
        """Device slots it holds at most (its KV: prompt + output - 1)."""
        return len(self.prompt) + len(self.output) - 1


def _chat(cfg, rng: random.Random, dists, system: list[int], c: int, turns: int, step: float,
          prefix: str, namespace: tuple) -> Plan:
    prompt_d, out_d = dists
    history, first, prev = list(system), None, None
    for t in range(turns):
        user = [rng.randrange(VOCAB) for _ in range(prompt_d.sample(rng))]
        prompt = history + user
        n_out = out_d.sample(rng)
        output = [rng.randrange(VOCAB) for _ in range(n_out)]
        plan = Plan(f"{prefix}c{c}t{t}", c, t, prompt, output, int(step),
                    extra_key=namespace[0], cache_salt=namespace[1])
        u = rng.random()
        if n_out >= 2 and u < cfg.abort_frac:
            plan.abort_at = rng.randint(1, n_out - 1)
            plan.output = output[: plan.abort_at]
        elif n_out >= 2 and u < cfg.abort_frac + cfg.retract_frac:
            plan.retract_at = rng.randint(1, n_out - 1)
        history = prompt + plan.output
        if prev is None:
            first = plan
        else:
            prev.next = plan
        prev = plan
    return first


def iter_chats(cfg, prefix: str = "") -> Iterator[Plan]:
    """The seed's chats in arrival order, each its first turn (later turns linked by ``next``).

    ``cfg`` must be validated (``config.validate``): lengths are then bounded and nothing here
    can fail. ``cfg.requests`` requests in all; the last chat may have fewer turns.
    """
    rng = random.Random(cfg.seed)
    names = random.Random(f"namespaces-{cfg.seed}")  # apart: the tokens stay those of the seed
    dists = parse_dist(cfg.prompt_len), parse_dist(cfg.output_len)
    system = [rng.randrange(VOCAB) for _ in range(cfg.system_prompt)]
    step, left, c = 0.0, cfg.requests, 0
    while left > 0:
        if cfg.arrival_rate > 0 and c:
            step += rng.expovariate(cfg.arrival_rate)
        turns = min(cfg.turns, left)
        yield _chat(cfg, rng, dists, system, c, turns, step, prefix, _namespace(cfg, names))
        left -= turns
        c += 1


def _namespace(cfg, names: random.Random) -> tuple:
    """(extra_key, cache_salt) of a chat: adapter ``lora-I`` for I drawn in 0..lora_adapters (0: the
    base model, None) and salt ``tenant-J`` for J in 0..cache_salts (0: unsalted, None)."""
    lora = names.randrange(cfg.lora_adapters + 1) if cfg.lora_adapters else 0
    salt = names.randrange(cfg.cache_salts + 1) if cfg.cache_salts else 0
    return (f"lora-{lora}" if lora else None), (f"tenant-{salt}" if salt else None)


def make_workload(cfg, prefix: str = "") -> list[Plan]:
    """The whole workload at once (tests and small runs; the scheduler takes ``iter_chats``)."""
    return list(iter_chats(cfg, prefix))


def all_plans(chats):
    """Every request of ``chats``, turn by turn."""
    for p in chats:
        while p is not None:
            yield p
            p = p.next


def kv_ids(tokens: list[int], namespace: str | None = None) -> list[int]:
    """The rolling prefix digest of every position: the synthetic KV of position ``p`` depends on
    every token up to and including ``p``, as a real model's does, and on the request's namespace
    (``hashing.namespace_seed`` of its LoRA id and salt; None: the base model's KV). A LoRA adapter
    computes other KV for the same tokens; a salt would not, but its KV differs here too, so a page
    read across namespaces is a mismatch the run counts."""
    out, h = [], _KVID_SEED if namespace is None else (_KVID_SEED + int(namespace[:15], 16)) % _KVID_MOD
    for t in tokens:
        h = (h * _KVID_MUL + t + 1) % _KVID_MOD
        out.append(h)
    return out

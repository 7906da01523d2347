"""The scheduler side's request handling (``lifecycle.integrations.vllm.store``) on vLLM-shaped
requests (no vLLM needed): requests whose pages would not mean what their tokens say are never
tracked; what "written" means; a row lists vLLM's slots past the prompt's whole pages."""

from __future__ import annotations

from types import SimpleNamespace

from lifecycle.integrations.vllm.store import StoreScheduler, VllmRequest

PS = 4


def _request(rid, prompt, *, outputs=(), computed=None, in_flight=0, **kw):
    tokens = list(prompt) + list(outputs)
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), all_token_ids=tokens,
                           num_tokens=len(tokens), num_computed_tokens=len(tokens) - 1 if computed is None else computed,
                           num_in_flight_tokens=in_flight, cache_salt=None, prompt_embeds=None,
                           prompt_is_token_ids=None, mm_features=[], lora_request=None, **kw)


def test_requests_whose_pages_would_not_mean_their_tokens_are_never_tracked():
    s = StoreScheduler(PS, 32, 16, max_len=64)
    bad = [_request("embeds", [1] * 8), _request("lora", [1] * 8), _request("mm", [1] * 8),
           _request("no-ids", [1] * 8)]
    bad[0].prompt_embeds = object()
    bad[1].lora_request = object()
    bad[2].mm_features = [object()]
    bad[3].prompt_token_ids = None
    for r in bad:
        s.admitted(r, [0, 1])
    assert s.skipped == 4 and not s.live
    s.admitted(_request("ok", [1] * 8), [0, 1])
    assert list(s.live) == ["ok"]


def test_written_counts_processed_forwards_and_never_the_last_sampled_token():
    r = _request("w", range(10), outputs=range(5), computed=16, in_flight=2)
    assert VllmRequest(r, 0).written() == 14            # 16 computed, 2 of them not processed yet
    r.num_in_flight_tokens = 0
    assert VllmRequest(r, 0).written() == 14            # 15 tokens: the last sampled one has no KV


def test_a_row_lists_vllm_slots_past_the_prompts_whole_pages_and_private_ids_before():
    s = StoreScheduler(PS, 32, 16, max_len=64)
    s.admitted(_request("r", range(10)), [7, 3, 9])
    req = s.live["r"]
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert row[8:12].tolist() == [36, 37, 38, 39]       # block 9: the page holding the prompt's end
    assert all(int(x) >= 32 * PS for x in row[:8])      # the prefill side's pages: never vLLM's slots
    assert req.kv.kv_allocated_len == 12


def test_pending_work_keeps_vllm_stepping_only_while_something_can_still_complete():
    from lifecycle.integrations.vllm.jobs import Report

    now = [100.0]
    s = StoreScheduler(PS, 32, 16, max_len=64, clock=lambda: now[0])
    assert not s.pending_work(30.0)
    host = s.proxy.write((__import__("torch").arange(PS) + 4 * PS), ack_id=1)
    assert host is not None and s.pending_work(30.0)
    s.completed(Report(expired={1: 1}), None)               # expired: nothing to wait for any more
    assert not s.pending_work(30.0)
    s.proxy.write((__import__("torch").arange(PS) + 5 * PS), ack_id=2)
    assert s.pending_work(30.0)
    now[0] += 31
    assert not s.pending_work(30.0)                         # no completion for 30 s: stop spinning

"""A prefix load stages through free host pages: stored pages beyond them are computed, and the
report counts them (``prefix_pages_unstaged``) instead of letting them pass for misses.

Regression: a two-process Mooncake run once found 216 of 225 stored prefix pages with no failed
lookup; the 9 were stored but cut off by ``min(full, free host pages)`` in admission, uncounted.
"""

from __future__ import annotations

import pytest

from lifecycle_tools.simulate import SimConfig, build, prepare, run

# every request's prompt (48-token system prompt + 16..32 tokens) has more full pages (>= 16) than
# the host pool holds (8 pages of 4 tokens): each lookup in the warm pass is cut to <= 8 pages
TIGHT = dict(requests=6, turns=2, prompt_len="16-32", output_len="8-16", layers=1, heads=1, head_dim=8,
             page_size=4, device_tokens=1024, host_tokens=32, rows=4, arrival_rate=0.5, seed=3,
             abort_frac=0.0, retract_frac=0.0, verify="none", storage="memory", warm=True)


def serve(**overrides):
    cfg = SimConfig(**{**TIGHT, **overrides})
    stack, mgr = build(cfg, prepare(cfg))
    return run(cfg, stack, mgr).passes


@pytest.mark.parametrize("host_tokens, cut", [(32, True), (4096, False)])
def test_stored_pages_beyond_the_free_host_pages_are_counted_not_lost(host_tokens, cut):
    cold, warm = serve(host_tokens=host_tokens)
    for p in (cold, warm):
        assert p.prefix_lookups_failed == 0 and p.prefix_mismatches == 0 and p.drained, p.errors
        assert p.slots_leaked == p.rows_leaked == p.host_pages_leaked == 0
    # the cold pass stored every prompt and output page: the warm pass finds all it looks up,
    # loading what fits through the host pool and counting the rest
    assert warm.prefix_pages_looked_up > 0
    assert warm.prefix_pages_hit + warm.prefix_pages_unstaged == warm.prefix_pages_looked_up, warm
    assert warm.prefix_pages_hit == warm.prefix_pages_verified > 0
    assert (warm.prefix_pages_unstaged > 0) is cut, warm
    if cut:  # every lookup ran into the 8 host pages
        assert warm.prefix_pages_hit <= 8 * warm.prefix_lookups

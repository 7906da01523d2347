from lifecycle.states import INITIAL, REFUSALS, TERMINAL, TRANSITIONS, State
from lifecycle.machine import CALLBACKS


def test_every_state_is_reachable_from_the_initial_state():
    seen, frontier = {INITIAL}, [INITIAL]
    while frontier:
        state = frontier.pop()
        for row in TRANSITIONS:
            sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
            if state in sources and row["dest"] not in seen:
                seen.add(row["dest"])
                frontier.append(row["dest"])
    assert seen == set(State)


def test_the_terminal_state_is_left_only_by_readmit():
    leaving = {r["trigger"] for r in TRANSITIONS
               if TERMINAL in (r["source"] if isinstance(r["source"], list) else [r["source"]])}
    assert leaving == {"readmit"}


def test_every_named_callback_exists():
    for row in TRANSITIONS:
        for key in ("conditions", "unless", "before", "after"):
            if key in row:
                assert row[key] in CALLBACKS, row


def test_the_required_transitions_are_declared():
    table = {(r["trigger"], s, r["dest"]) for r in TRANSITIONS
             for s in (r["source"] if isinstance(r["source"], list) else [r["source"]])}
    S = State
    required = {
        ("offload", S.PREFILLED, S.OFFLOADING), ("offload", S.INFLIGHT, S.OFFLOADING),
        ("enqueued", S.OFFLOADING, S.INFLIGHT),
        ("host_short", S.OFFLOADING, S.PREFILLED), ("host_short", S.OFFLOADING, S.INFLIGHT),
        ("landed", S.INFLIGHT, S.PREFILLED),
        ("finish", S.PREFILLED, S.FINISHED), ("finish", S.INFLIGHT, S.FINISHED),
        ("release", S.FINISHED, S.RELEASED), ("readmit", S.RELEASED, S.PREFILLED),
    }
    assert required <= table


def test_refusals_name_a_declared_trigger():
    triggers = {r["trigger"] for r in TRANSITIONS}
    assert {r.trigger for r in REFUSALS} <= triggers

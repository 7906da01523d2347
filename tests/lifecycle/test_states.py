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


def test_decide_walks_the_table_with_its_guards_and_names_the_refusal():
    from lifecycle.states import Facts, Refusal, decide

    assert decide("release", Facts(State.FINISHED, 0)) is State.RELEASED
    refusal = decide("release", Facts(State.FINISHED, 2))
    assert isinstance(refusal, Refusal) and refusal.guard == "!copies_in_flight"
    assert refusal.explain(Facts(State.FINISHED, 2)) == "2 copies still in flight"
    assert decide("finish", Facts(State.PREFILLED)).guard == "done"
    assert decide("finish", Facts(State.PREFILLED, finalizing=True)) is State.FINISHED
    assert decide("readmit", Facts(State.INFLIGHT, 1)).reason == "only a RELEASED request can be readmitted"


def test_a_guard_added_to_the_table_changes_what_decide_allows():
    from lifecycle.states import GUARDS, Facts, Refusal, decide

    guarded = tuple(dict(r, unless="copies_in_flight") if r["trigger"] == "finish" else r for r in TRANSITIONS)
    facts = Facts(State.INFLIGHT, 1, finalizing=True)
    assert decide("finish", facts) is State.FINISHED
    verdict = decide("finish", facts, table=guarded)
    assert isinstance(verdict, Refusal) and verdict.guard == "!copies_in_flight"
    guards = {**GUARDS, "done": lambda f: f.finished}  # a stricter predicate behind the same name
    assert isinstance(decide("finish", facts, guards=guards), Refusal)


def test_a_fresh_table_keeps_each_rows_conditions():
    """A table decided on for the first time (a fresh tuple: compiled now, not taken from the cache)
    applies every row's ``conditions`` as well as its ``unless``."""
    from lifecycle.states import Facts, Refusal, decide

    fresh = tuple(dict(r) for r in TRANSITIONS)
    refusal = decide("finish", Facts(State.PREFILLED), table=fresh)
    assert isinstance(refusal, Refusal) and refusal.guard == "done"
    assert decide("finish", Facts(State.PREFILLED, finalizing=True), table=fresh) is State.FINISHED
    assert decide("host_short", Facts(State.OFFLOADING, 1), table=fresh) is State.INFLIGHT
    assert decide("host_short", Facts(State.OFFLOADING, 0), table=fresh) is State.PREFILLED
    assert decide("finish", Facts(State.PREFILLED), table=list(fresh)).guard == "done"  # a list: compiled each time

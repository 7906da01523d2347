"""The pass report's verdict on sampled pages missing from storage: a missing page fails the run
only when nothing explains it (a refusal at the read, a failed or cut-off write, a failed or
expired copy, an eviction, an unreadable tier). CI found the hole this closes: a tier hung at the end of a pass, its writes cut
off by the drain (none failed), and the sampled pages of those writes failed the run."""

from lifecycle_tools.simulate.report import PassReport

UNEXPLAINED = "offloaded pages missing from storage (written, not refused, not found)"


def test_missing_pages_with_no_cause_fail_the_pass():
    rep = PassReport(verify_sampled=16, verify_ok=2, verify_missing=14)
    assert rep.problems() == [f"14 {UNEXPLAINED}"]
    assert rep.missing_causes() == ["14 not found"]


def test_pages_whose_writes_the_drain_cut_off_explain_as_many_missing_pages():
    rep = PassReport(verify_sampled=16, verify_ok=2, verify_missing=14, storage_ops_cut_off=100,
                     storage_pages_cut_off=128)
    assert rep.problems() == []
    assert rep.missing_causes() == ["14 not found: 128 pages' writes cut off at the end of the pass"]


def test_missing_pages_beyond_those_cut_off_still_fail_the_pass():
    rep = PassReport(verify_sampled=16, verify_missing=14, storage_ops_cut_off=3, storage_pages_cut_off=5)
    assert rep.problems() == [f"9 {UNEXPLAINED}"]


def test_refusals_at_the_read_and_cut_off_writes_add_up():
    rep = PassReport(verify_sampled=16, verify_missing=6, verify_refused_corrupt=2, verify_refused_foreign=1,
                     storage_pages_cut_off=2, pages_refused_corrupt=2)
    assert f"1 {UNEXPLAINED}" in rep.problems()
    assert rep.missing_causes() == ["2 refused as corrupt", "1 refused: another page, format or size",
                                    "3 not found: 2 pages' writes cut off at the end of the pass"]


def test_a_failed_write_or_an_unreadable_tier_explains_every_missing_page():
    for cause in ({"storage_failures": 1}, {"verify_unavailable": 1}, {"storage_evictions": 1},
                  {"chunks_failed": 1}):
        rep = PassReport(verify_sampled=16, verify_missing=14, **cause)
        assert UNEXPLAINED not in " ".join(rep.problems()), cause


def test_copies_that_failed_or_expired_are_named_as_the_cause():
    """A chunk whose copy failed or expired advanced its request's progress but is never stored (the
    soak's tiny copy deadline expires most copies): its pages are missing for that reason."""
    rep = PassReport(verify_sampled=16, verify_missing=14, chunks_failed=40)
    assert rep.problems() == []
    assert rep.missing_causes() == ["14 not found: 40 chunks' copies failed or expired (never stored)"]

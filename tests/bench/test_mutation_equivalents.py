"""``bench/mutation/equivalents.py``: every listed equivalent is tied to the source of the function it
was judged on, so a change that renumbers that function's mutants cannot hide a survivor behind an
old name. The guard on the repository's list runs in the campaign (``bench/mutation/campaign.py``), not here."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bench.mutation import campaign
from bench.mutation import equivalents as eq

ROOT = Path(__file__).resolve().parents[2]

MODULE = textwrap.dedent('''\
    import functools


    def helper(x):
        return x + 1


    class Pool:
        def __init__(self):
            self.n = 0

        @functools.lru_cache
        def free(self, k):
            return k * 2
    ''')


def tree(tmp_path: Path, text: str = MODULE) -> Path:
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(text)
    return tmp_path


def test_a_line_is_name_then_optional_hash_then_reason():
    assert eq.parse_line("m.x_a__mutmut_1  @0123456789ab  # speed # only") == \
        eq.Entry("m.x_a__mutmut_1", "0123456789ab", "speed # only")
    assert eq.parse_line("m.x_a__mutmut_1 # no hash") == eq.Entry("m.x_a__mutmut_1", None, "no hash")
    assert eq.parse_line("   ") is None
    for bad in ("m.x_a__mutmut_1 0123 # hash without @", "a b c # three words"):
        with pytest.raises(ValueError, match="name \\[@hash\\]"):
            eq.parse_line(bad)
    e = eq.Entry("m.x_a__mutmut_1", "0123456789ab", "why")
    assert eq.parse_line(eq.format_line(e)) == e
    assert eq.parse_line(eq.format_line(eq.Entry("m.x_a__mutmut_1", None, "why"))) == \
        eq.Entry("m.x_a__mutmut_1", None, "why")


def test_a_mutant_name_denotes_its_module_class_and_function():
    assert eq.target("hashing.chain.x__pack__mutmut_3") == eq.Target("hashing.chain", None, "_pack")
    assert eq.target("a.b.xǁPoolǁfree__mutmut_12") == eq.Target("a.b", "Pool", "free")
    assert eq.target("a.b.xǁPoolǁ__init____mutmut_1") == eq.Target("a.b", "Pool", "__init__")
    for bad in ("x_f__mutmut_1", "a.b.f__mutmut_1", "a.b.x_f__mutmut_", "a.b.x_f", "a.b.xǁPool__mutmut_1",
                "a.b.x___mutmut_1"):
        with pytest.raises(ValueError, match="mutmut"):
            eq.target(bad)


def test_the_function_source_is_found_decorators_included(tmp_path):
    root = tree(tmp_path)
    assert eq.function_source(root, eq.Target("pkg.mod", None, "helper")) == "def helper(x):\n    return x + 1"
    assert eq.function_source(root, eq.Target("pkg.mod", "Pool", "free")) == \
        "    @functools.lru_cache\n    def free(self, k):\n        return k * 2"
    for gone in (eq.Target("pkg.mod", None, "free"), eq.Target("pkg.mod", "Pool", "helper"),
                 eq.Target("pkg.mod", "Other", "free"), eq.Target("pkg.nope", None, "helper")):
        assert eq.function_source(root, gone) is None, gone
    assert eq.module_file(root, "pkg") == root / "pkg" / "__init__.py"


def judged(root: Path, name: str, reason: str = "same bytes") -> eq.Entry:
    return eq.Entry(name, eq.current_hashes([name], root)[name], reason)


def test_an_entry_goes_stale_when_its_function_changes_or_goes_and_only_then(tmp_path):
    root = tree(tmp_path)
    entries = [judged(root, "pkg.mod.x_helper__mutmut_1"), judged(root, "pkg.mod.xǁPoolǁfree__mutmut_2"),
               eq.Entry("pkg.mod.xǁPoolǁ__init____mutmut_1", None, "never hashed")]
    assert eq.stale(entries, root) == {"pkg.mod.xǁPoolǁ__init____mutmut_1": "no function hash recorded"}
    tree(tmp_path, MODULE.replace("self.n = 0", "self.n = 1"))      # another function changed
    assert list(eq.stale(entries, root)) == ["pkg.mod.xǁPoolǁ__init____mutmut_1"]
    tree(tmp_path, MODULE.replace("return k * 2", "k += 0\n        return k * 2"))   # renumbers free's mutants
    got = eq.stale(entries, root)
    assert got["pkg.mod.xǁPoolǁfree__mutmut_2"].startswith("its function changed (hash ")
    assert "pkg.mod.x_helper__mutmut_1" not in got
    tree(tmp_path, MODULE.replace("def helper", "def assist"))
    assert eq.stale(entries, root)["pkg.mod.x_helper__mutmut_1"] == "its function is gone"


def test_the_campaign_counts_a_stale_entry_as_a_survivor(tmp_path, monkeypatch):
    root = tree(tmp_path)
    fresh, old = judged(root, "pkg.mod.x_helper__mutmut_1", "a"), judged(root, "pkg.mod.xǁPoolǁfree__mutmut_2", "b")
    listing = tmp_path / "eq.txt"
    eq.rewrite([fresh, old], listing)
    monkeypatch.setattr(campaign, "EQUIVALENT_FILE", listing)
    assert campaign.load_equivalent() == {fresh.name: "a", old.name: "b"}      # no tree: as listed
    tree(tmp_path, MODULE.replace("return k * 2", "return k * 3"))
    equivalent = campaign.load_equivalent(root)
    assert equivalent == {fresh.name: "a"}
    assert list(campaign.judge_equivalent(root)[1]) == [old.name]
    c = campaign.tally({fresh.name: "survived", old.name: "survived"}, equivalent)
    assert (c["equivalent"], c["survived"]) == (1, 1)


def test_refresh_records_the_current_hash_of_the_named_entries_only(tmp_path):
    root = tree(tmp_path)
    listing = tmp_path / "eq.txt"
    a, b = eq.Entry("pkg.mod.x_helper__mutmut_1", None, "a"), eq.Entry("pkg.mod.xǁPoolǁfree__mutmut_2", None, "b")
    eq.rewrite([a, b], listing)
    assert eq.main(["--check"], root, listing) == 1
    assert eq.main(["--refresh", b.name], root, listing) == 0
    got = {e.name: e for e in eq.load(listing)}
    assert got[a.name] == a and got[b.name] == judged(root, b.name, "b")
    before = listing.read_text()
    assert eq.main(["--refresh", "pkg.mod.x_nope__mutmut_1"], root, listing) == 2     # not listed
    tree(tmp_path, MODULE.replace("def helper", "def assist"))
    assert eq.main(["--refresh-all"], root, listing) == 2                             # a function gone
    assert listing.read_text() == before                                              # nothing written
    tree(tmp_path)
    assert eq.main(["--refresh-all"], root, listing) == 0 and eq.main(["--check"], root, listing) == 0


def test_the_diff_shown_is_the_mutant_mutmut_makes(tmp_path):
    pytest.importorskip("mutmut")     # the mutation extra; the guard above needs no mutmut
    got = eq.diffs(["pkg.mod.x_helper__mutmut_1", "pkg.mod.x_helper__mutmut_999", "pkg.nope.x_f__mutmut_1"],
                   tree(tmp_path))
    assert "-    return x + 1" in got["pkg.mod.x_helper__mutmut_1"]
    assert "+    return x - 1" in got["pkg.mod.x_helper__mutmut_1"]
    assert got["pkg.mod.x_helper__mutmut_999"] is None and got["pkg.nope.x_f__mutmut_1"] is None

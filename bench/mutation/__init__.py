"""The mutation campaign (mutmut 3; not part of CI; see docs/reliability.md).

``campaign`` runs it, group by group (``.venv/bin/python bench/mutation/campaign.py``); ``map`` says
what each group mutates and which tests it runs; ``order`` is the pytest plugin the campaign loads
(``-p bench.mutation.order``: each mutant's tests cheapest first); ``fresh`` re-runs mutants one fresh
interpreter each; ``equivalents`` keeps ``equivalent.txt``, the known-equivalent mutants, each tied to
the source of its function (``--check``: the campaign's guard on the list). Nothing is imported here."""

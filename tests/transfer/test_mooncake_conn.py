"""``transfer/storage/mooncake/conn.py`` without a master: what Mooncake's return codes are called in
our log lines and breaker reasons (``mooncake.write_failed code=...``)."""

from __future__ import annotations

import pytest

from transfer.storage.mooncake import conn


@pytest.mark.parametrize("code,name", [(conn.NO_SPACE, "NO_AVAILABLE_HANDLE(-200)"), (-704, "OBJECT_NOT_FOUND(-704)"),
                                       (conn.EXISTS, "OBJECT_ALREADY_EXISTS(-705)"), (-900, "RPC_FAIL(-900)"),
                                       (-1, "INTERNAL_ERROR(-1)")])
def test_a_known_code_is_named_with_its_number(code, name):
    assert conn.code_name(code) == name


@pytest.mark.parametrize("code", [-12345, -702, 7])
def test_an_unknown_code_is_a_generic_error_with_its_number(code):
    assert conn.code_name(code) == f"ERROR({code})"


def test_a_size_that_is_not_one_is_refused_with_the_text_and_examples():
    from transfer.errors import StorageConfigError

    with pytest.raises(StorageConfigError, match=r"^not a byte size: 'lots' \(e\.g\. 256MiB, 4GB, 1048576\)$"):
        conn.parse_size("lots")
    assert [conn.parse_size(t) for t in ("7", "2k", "3MiB", "1g", "1T")] == [7, 2 << 10, 3 << 20, 1 << 30, 1 << 40]

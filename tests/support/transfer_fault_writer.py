"""Child process of tests/transfer/test_faults_kill.py: writes a burst of pages through FileStorage
until it is killed. Prints "ready" once imported, waits for a line on stdin, then writes page i
(key ``page_key(i)``, bytes ``page_bytes(i)``) one ``batch_set`` at a time and prints ``i`` after
each returns True. Run: python -m tests.support.transfer_fault_writer DIR"""

from __future__ import annotations

import hashlib
import sys

import torch

from transfer import FileStorage

SUFFIX = "_org-model_0_1"
NB = 1 << 20  # big enough that a kill often lands inside a write; the crc runs on the helper thread


def page_key(i: int) -> str:
    return f"{i:064x}"


def page_bytes(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=64).digest() * (NB // 64)


def main(directory: str, limit: int = 100_000) -> None:
    store = FileStorage(directory, SUFFIX, NB)
    print("ready", flush=True)
    sys.stdin.readline()
    nxt = torch.frombuffer(bytearray(page_bytes(0)), dtype=torch.uint8)
    for i in range(limit):
        page = nxt
        assert store.batch_set([page_key(i)], [page]) == [True]
        nxt = torch.frombuffer(bytearray(page_bytes(i + 1)), dtype=torch.uint8)  # before the print:
        print(i, flush=True)  # after it the writer is straight into the next write


if __name__ == "__main__":
    main(sys.argv[1])

"""The seam between lifecycle policy and transfer mechanism.

The lifecycle manager decides *what* to copy and *when* to free; an ``Offloader`` decides *how*
bytes move. Work is named by ids the caller chooses (ack ids) or the offloader returns (op ids),
and completions are polled, never waited on.

The contract is the ``Offloader`` protocol below, all of it: the manager checks once, at
construction, that an offloader has every method (``ConfigError`` naming the missing ones) and
never probes for optional parts afterwards. A copy's outcome comes back in one poll,
``finished_writes() -> WriteReport``, with three lists:

``landed``
    Acks whose device -> host copy ended and whose host pages hold the KV: the caller may store
    them (``write_storage``) and its device slots are no longer read.
``failed``
    Acks whose copy ended but whose host pages must never be stored: the copy raised, or it had
    expired. Its device slots are no longer read; the caller frees the host pages (``free_host``).
    A ``write_storage`` of them anyway yields a failed op and writes nothing.
``expired``
    Acks whose copy has not ended ``write_timeout_s`` after it was submitted (or that the caller
    discarded). The copy is not cancelled and may *still be reading its device slots*: the caller
    keeps them allocated until the same ack is reported ended, and never stores its host pages
    (``HostOffloader`` reports it ``failed``; the manager treats a ``landed`` one the same).

Each ack given to ``write`` is reported in ``landed`` or ``failed`` exactly once; in ``expired``
at most once, and never after its ``landed``/``failed`` report (it may share that report: the
caller handles ``expired`` first). ``EMPTY_REPORT`` is the report of a poll with nothing to say.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import msgspec
import numpy as np
import torch


class WriteReport(msgspec.Struct, frozen=True, gc=False):
    """One ``finished_writes`` poll: the acks that landed, failed, or expired since the last
    (the module docstring has the contract). Lists, never None; read, never mutated."""

    landed: list[int]
    failed: list[int]
    expired: list[int]


#: The report of a poll with nothing to say (shared: a step with no completion allocates nothing).
EMPTY_REPORT = WriteReport([], [], [])


@runtime_checkable
class Offloader(Protocol):
    """Moves KV pages device -> host -> storage on the caller's behalf.

    Contract:
        * Every method is called from the scheduler thread and returns without blocking on a copy
          or on storage I/O.
        * ``write`` enqueues one chunk. Until its ack id is reported landed or failed by
          ``finished_writes`` the device slots it reads must stay allocated (the caller
          guarantees this), expired or not.
        * Each ack id given to ``write`` is reported by ``finished_writes`` landed or failed
          exactly once, expired at most once and not after that, in any order relative to other
          acks; each op id returned by ``write_storage`` is reported by
          ``finished_storage`` exactly once, whether the op succeeded or failed.
        * Host pages returned by ``write`` belong to the caller until it passes them to
          ``free_host``.

    ``lifecycle.config.offloader`` checks every method below once, at construction.
    """

    def write(self, device_indices: torch.Tensor | np.ndarray, ack_id: int) -> torch.Tensor | np.ndarray | None:
        """Enqueue a device -> host copy of the KV at ``device_indices`` (token slots).

        Args:
            device_indices: int64 token-slot indices, a whole number of pages, page-aligned: a
                1-D NumPy array when the row table is in host memory (the manager hands a host
                row's ids over as NumPy: no tensor is made on the scheduler thread), a tensor
                when it is on a device. The offloader never reads the caller's buffer after
                returning (it copies what it keeps).
            ack_id: caller-chosen id, reported by ``finished_writes`` when the copy has ended.
        Returns:
            The host token indices that will hold the copy (what the caller hands back to
            ``write_storage`` and ``free_host``; ``HostOffloader``: a read-only NumPy array for
            NumPy ids, a tensor for a tensor), or None when host memory is short (then nothing
            was enqueued and ``ack_id`` will never be reported).
        """
        ...

    def finished_writes(self) -> WriteReport:
        """The acks that landed, failed or expired since the last call (module docstring). Never
        blocks; order within a list not guaranteed."""
        ...

    def write_storage(
        self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str],
        parent_hash: str | None = None,
    ) -> int:
        """Enqueue host -> storage of ``len(page_hashes)`` pages held at ``host_indices``.

        Args:
            host_indices: host token indices returned by ``write`` (a tensor or NumPy array).
            tokens: the token ids those pages hold (``len == pages * page_size``).
            page_hashes: the pages' chain names, fixed by the caller when the chunk was enqueued.
            parent_hash: the page before the first one (KV events link pages to it;
                ``docs/metrics.md``); None: the first page of a prompt, or unknown.
        Returns:
            An op id, reported by ``finished_storage`` when the op succeeded or failed.
        """
        ...

    def finished_storage(self) -> list[int]:
        """Op ids finished (success or failure) since the last call. Never blocks."""
        ...

    def free_host(self, host_indices: torch.Tensor | list[torch.Tensor]) -> None:
        """Return host pages to the host pool: the pages of one tensor of host indices ``write``
        returned, or of a list of them (several ops' pages in one call: the manager frees the
        storage ops a progress check saw finish this way). Raises on a double free (or pages a
        copy or storage op still uses), and then frees none of them: the manager, refused one call
        for several ops' pages, frees them op by op."""
        ...

    def close(self, timeout: float | None):
        """Refuse new work and wait at most ``timeout`` seconds (None: no bound) for work in
        flight; called once by the manager's ``shutdown`` with what is left of its deadline
        (positionally). May return a report: one whose ``clean`` is False (something abandoned)
        is logged by the manager; any other return value is ignored."""
        ...

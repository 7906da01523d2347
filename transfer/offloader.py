"""The seam between lifecycle policy and transfer mechanism.

The lifecycle manager decides *what* to copy and *when* to free; an ``Offloader`` decides *how*
bytes move. Work is named by ids the caller chooses (ack ids) or the offloader returns (op ids),
and completions are polled, never waited on.

Optional extensions (not part of the ``Offloader`` protocol: an offloader may lack them, so a caller
looks them up with ``getattr(offloader, name, None)``; ``HostOffloader`` has both). They add
information and change no contract of the protocol's methods:

``expired_writes() -> list[int]``
    Ack ids whose device -> host copy has not finished ``write_timeout_s`` after it was submitted,
    since the last call; each ack at most once, never one already reported by
    ``finished_writes``. Never blocks. An expired copy is not cancelled and may *still be reading
    its device slots*: the caller must keep those slots allocated until the same ack is reported by
    ``finished_writes`` (if the copy ever ends, successfully or not). That ack is then also listed
    by ``failed_writes``: its host pages never hold a page worth storing (``write_storage`` of them
    yields a failed op), and they are the caller's to ``free_host``.

``failed_writes() -> list[int]``
    Ack ids reported by ``finished_writes`` since the last call whose host pages must not be
    stored: the copy raised, or it had expired. Each at most once, and only after (or in the same
    poll as) ``finished_writes`` reported it. The caller skips ``write_storage`` for them and frees
    their host pages; if it stores them anyway the op is reported failed and nothing is written.

``stores_parent_hash = True`` (a class attribute)
    ``write_storage`` takes a fourth argument, ``parent_hash``: the page before the first one (KV
    events link pages to it; ``docs/metrics.md``). The manager passes it only to offloaders that
    say so.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Offloader(Protocol):
    """Moves KV pages device -> host -> storage on the caller's behalf.

    Contract:
        * Every method is called from the scheduler thread and returns without blocking on a copy
          or on storage I/O.
        * ``write`` enqueues one chunk. Until its ack id is reported by ``finished_writes`` the
          device slots it reads must stay allocated (the caller guarantees this).
        * Each ack id given to ``write`` is reported by ``finished_writes`` exactly once, in any
          order relative to other acks; each op id returned by ``write_storage`` is reported by
          ``finished_storage`` exactly once, whether the op succeeded or failed.
        * Host pages returned by ``write`` belong to the caller until it passes them to
          ``free_host``.

    See the module docstring for the optional ``expired_writes`` / ``failed_writes`` extensions.
    """

    def write(self, device_indices: torch.Tensor, ack_id: int) -> torch.Tensor | None:
        """Enqueue a device -> host copy of the KV at ``device_indices`` (token slots).

        Args:
            device_indices: int64 token-slot indices, a whole number of pages, page-aligned.
            ack_id: caller-chosen id, reported by ``finished_writes`` when the copy has landed.
        Returns:
            The host token indices that will hold the copy, or None when host memory is short
            (then nothing was enqueued and ``ack_id`` will never be reported).
        """
        ...

    def finished_writes(self) -> list[int]:
        """Ack ids whose copy landed since the last call. Never blocks; order not guaranteed."""
        ...

    def write_storage(
        self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str]
    ) -> int:
        """Enqueue host -> storage of ``len(page_hashes)`` pages held at ``host_indices``.

        Args:
            host_indices: host token indices returned by ``write``.
            tokens: the token ids those pages hold (``len == pages * page_size``).
            page_hashes: the pages' chain names, fixed by the caller when the chunk was enqueued.
        Returns:
            An op id, reported by ``finished_storage`` when the op succeeded or failed.
        """
        ...

    def finished_storage(self) -> list[int]:
        """Op ids finished (success or failure) since the last call. Never blocks."""
        ...

    def free_host(self, host_indices: torch.Tensor) -> None:
        """Return host pages to the host pool. Raises on a double free."""
        ...

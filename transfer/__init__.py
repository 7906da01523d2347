"""Mechanism: KV and host memory, the copy engine and storage. Executes jobs; decides nothing."""

from transfer.memory import InMemoryOffloader, OffloaderMisuse
from transfer.offloader import Offloader

__all__ = ["InMemoryOffloader", "Offloader", "OffloaderMisuse"]

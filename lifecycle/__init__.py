"""kv-lifecycle: an explicit, checked lifecycle for a decode node's KV cache."""

from lifecycle.errors import (
    ConfigError,
    IntegrityError,
    InvalidRequest,
    InvalidTransition,
    LifecycleError,
    ManagerClosed,
    UnknownCompletion,
)
from lifecycle.manager import DecodeOffloadManager
from lifecycle.records import OffloadedState, Stats
from lifecycle.states import State

__all__ = [
    "ConfigError",
    "DecodeOffloadManager",
    "IntegrityError",
    "InvalidRequest",
    "InvalidTransition",
    "LifecycleError",
    "ManagerClosed",
    "OffloadedState",
    "State",
    "Stats",
    "UnknownCompletion",
]

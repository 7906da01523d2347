"""kv-lifecycle: an explicit, checked lifecycle for a decode node's KV cache."""

from lifecycle.errors import (
    ConfigError,
    IntegrityError,
    InvalidArgument,
    InvalidRequest,
    InvalidSlots,
    InvalidToken,
    InvalidTransition,
    LifecycleError,
    ManagerClosed,
    ReentrantCall,
    UnknownCompletion,
)
from lifecycle.manager import DecodeOffloadManager
from lifecycle.records import OffloadedState, Stats
from lifecycle.release import AllocatorReleaseSink, ReleasePlan, ReleaseRefused, ReleaseSink
from lifecycle.states import State

__all__ = [
    "AllocatorReleaseSink",
    "ConfigError",
    "DecodeOffloadManager",
    "IntegrityError",
    "InvalidArgument",
    "InvalidRequest",
    "InvalidSlots",
    "InvalidToken",
    "InvalidTransition",
    "LifecycleError",
    "ManagerClosed",
    "OffloadedState",
    "ReentrantCall",
    "ReleasePlan",
    "ReleaseRefused",
    "ReleaseSink",
    "State",
    "Stats",
    "UnknownCompletion",
]

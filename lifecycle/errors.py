"""One error hierarchy. Every refused call raises before it changes anything."""

from __future__ import annotations

from transitions import MachineError

from hashing import TokenRangeError as _HashingTokenRangeError


class LifecycleError(Exception):
    """Base of every error the lifecycle raises."""


class InvalidTransition(LifecycleError, MachineError):
    """An event that the request's state (or its copies in flight) does not allow.

    Attributes:
        rid: the request's id (``None`` when it has none).
        trigger: the event refused (``offload``, ``release``, ...).
        state: the state name the request was in, or ``"UNSEEN"``.
        reason: why it was refused.
    """

    def __init__(self, rid: object, trigger: str, state: str, reason: str) -> None:
        self.rid, self.trigger, self.state, self.reason = rid, trigger, state, reason
        message = f"request {rid!r}: cannot {trigger!r} in state {state}: {reason}"
        MachineError.__init__(self, message)
        Exception.__init__(self, message)

    def __str__(self) -> str:
        return self.value


class InvalidRequest(LifecycleError, ValueError):
    """The request object is malformed (no row, inconsistent lengths, wrong types)."""


class InvalidToken(InvalidRequest, _HashingTokenRangeError):
    """A token id of the request is not an int in 0..2**32-1; names the token and its position
    in the request (``origin_input_ids + output_ids``). Also a ``hashing.TokenRangeError``."""


class ReentrantCall(LifecycleError, RuntimeError):
    """A manager call made while the same manager is inside another call (e.g. from a log
    processor or an offloader callback); refused before it changes anything."""


class ConfigError(LifecycleError, ValueError):
    """The manager was configured with impossible values (page size, stride)."""


class UnknownCompletion(LifecycleError):
    """The offloader reported an ack or op id the manager never issued (or already settled)."""


class IntegrityError(LifecycleError):
    """The manager's tables disagree; raised by ``check_integrity``."""


class InvalidArgument(LifecycleError, ValueError):
    """A call's argument is outside its domain (a ``shutdown`` timeout that is not a finite number
    >= 0, a ``force`` that is not a bool); refused before anything changes."""


class ManagerClosed(LifecycleError):
    """A call after ``shutdown``."""


class InvalidSlots(InvalidRequest):
    """A plan's device slot ids cannot be right: a negative (never written) or repeated id, an id a
    copy in flight still reads, or one the allocator does not hold. Names the request, its row, the
    slot and the token ranges; raised before anything changes (``lifecycle.slots``)."""

"""``lifecycle.errors``: one hierarchy; a refused transition names the request, the trigger, the
state and the reason, in its message, its attributes and its args (what ``repr`` and logs show)."""

from __future__ import annotations

import pytest
from transitions import MachineError

from lifecycle.errors import (
    ConfigError, IntegrityError, InvalidArgument, InvalidRequest, InvalidSlots, InvalidToken, InvalidTransition,
    LifecycleError, ManagerClosed, ReentrantCall, UnknownCompletion,
)


def test_an_invalid_transition_carries_its_message_everywhere_an_exception_shows_it():
    err = InvalidTransition("r7", "release", "FINISHED", "2 copies still in flight")
    message = "request 'r7': cannot 'release' in state FINISHED: 2 copies still in flight"
    assert (err.rid, err.trigger, err.state, err.reason) == ("r7", "release", "FINISHED", "2 copies still in flight")
    assert str(err) == message and err.value == message          # MachineError's value
    assert err.args == (message,) and repr(err) == f"InvalidTransition({message!r})"
    with pytest.raises(MachineError, match=r"^request 'r7': cannot 'release' in state FINISHED: 2 copies"):
        raise err
    none = InvalidTransition(None, "readmit", "UNSEEN", "the request was never seen")
    assert str(none) == "request None: cannot 'readmit' in state UNSEEN: the request was never seen"
    assert none.args == (str(none),)


def test_every_error_is_a_lifecycle_error_and_the_request_errors_are_value_errors():
    for cls in (InvalidTransition, InvalidRequest, InvalidToken, ReentrantCall, ConfigError, UnknownCompletion,
                IntegrityError, InvalidArgument, ManagerClosed, InvalidSlots):
        assert issubclass(cls, LifecycleError)
    for cls in (InvalidRequest, InvalidToken, ConfigError, InvalidArgument, InvalidSlots):
        assert issubclass(cls, ValueError)
    assert issubclass(ReentrantCall, RuntimeError) and issubclass(InvalidSlots, InvalidRequest)

"""The scheduler's calls into the manager, timed, with the manager's refusals counted."""

from __future__ import annotations

import time
from array import array

from lifecycle.errors import LifecycleError
from lifecycle_tools.simulate.report import PassReport
from transfer.errors import DoubleFree, InvalidFree


class ManagerCalls:
    """Runs manager calls for the scheduler loop.

    ``step_ns`` accumulates the time spent inside them (reset by the loop each step). A
    ``DoubleFree`` or a lifecycle error is counted in the pass report and returns None: the
    simulation goes on and the report says what went wrong.
    """

    def __init__(self) -> None:
        self.step_ns = 0
        self.rep = PassReport()

    def __call__(self, fn, *args):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        except DoubleFree as err:
            self.rep.double_frees += 1
            self.rep.error(f"DoubleFree: {err}")
        except (LifecycleError, InvalidFree) as err:
            self.rep.lifecycle_errors += 1
            self.rep.error(f"{type(err).__name__}: {err}")
        finally:
            self.step_ns += time.perf_counter_ns() - t0
        return None


class EnqueueTimer:
    """Times the offloader's ``write`` (the enqueue of one chunk, on the scheduler thread).

    Installed on the offloader object before the manager is built (``install``); ``samples_us``
    holds one duration per chunk until ``reset``.
    """

    def __init__(self) -> None:
        self.samples_us = array("d")

    def install(self, offloader) -> None:
        inner = offloader.write
        samples = self.samples_us

        def write(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                samples.append((time.perf_counter_ns() - t0) / 1000.0)

        offloader.write = write

    def reset(self) -> None:
        del self.samples_us[:]

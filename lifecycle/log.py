"""The lifecycle package's loggers: quiet by default, configurable at any time.

The factory is the one in ``transfer.log`` (see its docstring for the routing rules): events go
through structlog when the application configured it (``capture_logs``, ``kv-lifecycle --audit``)
and otherwise to the stdlib ``logging`` logger ``lifecycle``, filtered by its level at every call.
"""

from transfer.log import Logger, RateLimitedLog, get_logger

__all__ = ["Logger", "RateLimitedLog", "get_logger"]

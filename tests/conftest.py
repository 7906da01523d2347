import structlog
import pytest

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import PagedAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader
from lifecycle_tools.testkit.redis_server import make_redis_server, redis_session_server, redis_url  # noqa: F401 (fixtures)


class Node:
    """A manager wired to strict doubles and an in-memory offloader, for one test."""

    def __init__(self, page_size=4, stride=None, auto_land=False, host_pages=1 << 12, seed=None, alloc_page=None,
                 manager_cls=DecodeOffloadManager):
        self.pool = ReqToTokenPool()
        self.alloc = PagedAllocator(page_size=alloc_page or page_size)
        self.off = InMemoryOffloader(page_size=page_size, host_pages=host_pages, auto_land=auto_land)
        self.mgr = manager_cls(
            self.pool, self.alloc, page_size=page_size, offloader=self.off,
            offload_stride=stride, namespace_seed=seed,
        )

    def land_all(self):
        self.off.land()
        self.mgr.check_offload_progress()

    def store_all(self):
        self.off.complete_storage()
        self.mgr.check_offload_progress()


@pytest.fixture
def node():
    return Node()


@pytest.fixture
def make_node():
    return Node


def _drop(logger, name, event_dict):
    raise structlog.DropEvent


# Tests read logs through structlog.testing.capture_logs; elsewhere, don't print them.
structlog.configure(processors=[_drop])

"""The ``rig`` fixture: a test runs once over the doubles and once over the real pools
(``tests.support.rigs``)."""

import pytest

from tests.support.rigs import RIGS


@pytest.fixture(params=list(RIGS), ids=list(RIGS))
def rig(request):
    """A manager over one kind of pools (``doubles`` or ``real-pools``), page size 4."""
    return RIGS[request.param]()

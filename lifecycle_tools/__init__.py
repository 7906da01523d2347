"""The tools behind the ``kv-lifecycle`` command: the reference scheduler (``simulate``), audit
replay, the timeline picture and diagram generation, plus the test kit (``lifecycle_tools.testkit``).

Kept apart from the library: ``lifecycle``, ``transfer`` and ``hashing`` never import this package.
"""

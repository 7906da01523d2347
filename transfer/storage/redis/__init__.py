"""The Redis / Valkey tier and Redis Cluster (``redis://``, ``redis+cluster://`` specs; ``open_storage``).

``store`` ``RedisStorage`` (keys, seal + bytes per value, ``SET NX``, TTL, repair); ``get`` its read
path (a mixin); ``reader`` / ``wire`` the read and write paths at wire level; ``conn`` URL checks and
the client; ``cluster`` ``RedisClusterStorage``; ``ask`` Cluster ``ASK`` redirections. Nothing is
imported here: ``transfer.storage.RedisStorage`` / ``RedisClusterStorage`` load the client on first use."""

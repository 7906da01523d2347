"""Integrations of the lifecycle into serving engines. Each is imported on demand; none is imported
by ``lifecycle`` itself, and none imports its engine at import time.

``lifecycle.integrations.sglang``: a drop-in for SGLang 0.5.19's ``DecodeKVCacheOffloadManager``.
"""

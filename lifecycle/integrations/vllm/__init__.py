"""kv-lifecycle inside vLLM (0.32.0): a KV connector (``KVConnectorBase_V1``) loaded by module path.

``kv_transfer_config={"kv_connector": "LifecycleConnector", "kv_connector_module_path":
"lifecycle.integrations.vllm.connector", "kv_role": "kv_both"}``. See docs/integration.md, "Running
inside vLLM". Nothing here imports vllm until the connector module is imported.
"""

from lifecycle.integrations.vllm.errors import VllmConfigError, VllmLayoutError
from lifecycle.integrations.vllm.layout import VllmKVLayout

__all__ = ["VllmConfigError", "VllmKVLayout", "VllmLayoutError"]

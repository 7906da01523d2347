"""The Mooncake tier (``mooncake://`` specs; ``open_storage``), SGLang 0.5.19's object names and bytes.

``store`` ``MooncakeStorage``; ``keys`` SGLang's object names; ``owned`` what a store may repair or
remove; ``session`` one client's life (connect, calls in flight, close); ``buffers`` registered
memory (bounded); ``conn`` settings, bounded connect, return codes. Nothing is imported here:
``transfer.storage.MooncakeStorage`` loads it on first use, the client wheel only when a store opens."""

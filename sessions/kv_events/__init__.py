"""Attach to a vLLM or SGLang server's KV-cache events (ZMQ + msgpack), mirror its cache, and
publish our own engine's cache in the same format. No Qt, no torch.

    from kvscope.sessions.kv_events import Attachment, Mirror, KVEventPublisher, decode_batch
"""

from kvscope.sessions.kv_events.mirror import Health, Mirror
from kvscope.sessions.kv_events.publisher import KVEventPublisher
from kvscope.sessions.kv_events.subscriber import Attachment
from kvscope.sessions.kv_events.wire import (
    Batch,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode_batch,
    encode_batch,
)

__all__ = ["Attachment", "Batch", "Cleared", "Health", "KVEventPublisher", "Mirror", "Removed",
           "Stored", "WireError", "decode_batch", "encode_batch"]

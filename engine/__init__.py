"""The paged-KV inference engine. Pure Python + torch; never imports Qt or kvscope.app.

Importing this package does not import torch: the cache manager, snapshots and events are
torch-free so that tools that only read recordings stay light.
"""

from kvscope.engine.block_pool import NoFreeBlocksError
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.snapshot import Snapshot

__all__ = ["KVCacheManager", "MissExplanation", "NoFreeBlocksError", "Snapshot"]

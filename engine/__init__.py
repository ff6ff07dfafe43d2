"""The paged-KV inference engine. Pure Python + torch; never imports Qt or kvscope.app.

`Engine` (and so torch) is imported lazily: the cache manager, snapshots and events are
torch-free, so tools that only read recordings stay light.
"""

from kvscope.engine.block_pool import NoFreeBlocksError
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.metrics import RequestMetrics, StepRecord
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.snapshot import CacheCounters, Snapshot
from kvscope.engine.stream import NewRequest, StepQueue, StepUpdate

__all__ = ["CacheCounters", "Engine", "EngineConfig", "KVCacheManager", "MissExplanation",
           "NewRequest", "NoFreeBlocksError", "RequestMetrics", "RequestOutput", "SamplingParams",
           "Snapshot", "StepQueue", "StepRecord", "StepUpdate"]


def __getattr__(name):
    if name == "Engine":
        from kvscope.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")

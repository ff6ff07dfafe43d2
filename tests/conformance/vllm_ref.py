"""vLLM's own parts that the conformance tests compare against, imported on first use:
`vllm_ref.BlockStored` and so on (PEP 562). Importing vLLM takes 10 s on these machines (its
env_override imports torch._inductor) and every pytest-xdist worker collects every test module,
while one worker runs them all (SHARED_SETUP in tests/conftest.py)."""

from __future__ import annotations

import functools
import importlib

# name -> (module, attribute in it; None: the module itself)
NAMES = {
    "block_pool": ("vllm.v1.core.block_pool", None),
    "kv_cache_utils": ("vllm.v1.core.kv_cache_utils", None),
    "AllBlocksCleared": ("vllm.distributed.kv_events", "AllBlocksCleared"),
    "BlockRemoved": ("vllm.distributed.kv_events", "BlockRemoved"),
    "BlockStored": ("vllm.distributed.kv_events", "BlockStored"),
    "KVEventBatch": ("vllm.distributed.kv_events", "KVEventBatch"),
    "ZmqEventPublisher": ("vllm.distributed.kv_events", "ZmqEventPublisher"),
    "LoRARequest": ("vllm.lora.request", "LoRARequest"),
    "MultiModalFeatureSpec": ("vllm.multimodal.inputs", "MultiModalFeatureSpec"),
    "PlaceholderRange": ("vllm.multimodal.inputs", "PlaceholderRange"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "sha256": ("vllm.utils.hashing", "sha256"),
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    "KVCacheBlock": ("vllm.v1.core.kv_cache_utils", "KVCacheBlock"),
    "get_block_hash": ("vllm.v1.core.kv_cache_utils", "get_block_hash"),
    "get_request_block_hasher": ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
    "hash_block_tokens": ("vllm.v1.core.kv_cache_utils", "hash_block_tokens"),
    "maybe_convert_block_hash": ("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash"),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),
    "Request": ("vllm.v1.request", "Request"),
}


@functools.cache
def _first_use() -> None:
    """vLLM's hash of the first block's parent, set once before anything hashes."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    utils.init_none_hash(importlib.import_module("vllm.utils.hashing").sha256)


def __getattr__(name: str):
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _first_use()
    module, attribute = NAMES[name]
    m = importlib.import_module(module)
    return m if attribute is None else getattr(m, attribute)

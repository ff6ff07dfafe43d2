"""vLLM's own parts that the conformance tests compare against, imported on first use:
`vllm_ref.BlockStored` and so on (PEP 562). Importing vLLM takes 10 s on these machines (its
env_override imports torch._inductor) and every pytest-xdist worker collects every test module,
while one worker runs them all (SHARED_SETUP in tests/conftest.py)."""

from __future__ import annotations

import functools
import importlib

# vLLM modules used whole (monkeypatched)
MODULES = {"block_pool": "vllm.v1.core.block_pool", "kv_cache_utils": "vllm.v1.core.kv_cache_utils"}
# name -> the vLLM module that defines it
NAMES = {
    **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
                     "ZmqEventPublisher"), "vllm.distributed.kv_events"),
    "LoRARequest": "vllm.lora.request",
    "MultiModalFeatureSpec": "vllm.multimodal.inputs",
    "PlaceholderRange": "vllm.multimodal.inputs",
    "SamplingParams": "vllm.sampling_params",
    "sha256": "vllm.utils.hashing",
    "KVCacheManager": "vllm.v1.core.kv_cache_manager",
    **dict.fromkeys(("KVCacheBlock", "get_block_hash", "get_group_id", "get_request_block_hasher",
                     "hash_block_tokens", "maybe_convert_block_hash"),
                    "vllm.v1.core.kv_cache_utils"),
    **dict.fromkeys(("FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec",
                     "SlidingWindowSpec"),
                    "vllm.v1.kv_cache_interface"),
    "Request": "vllm.v1.request",
    # the offloading connector's own event translation (its CPU tier's two forms)
    **dict.fromkeys(("OffloadingEventGroupSpec", "OffloadingEventsTracker"),
                    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events"),
    "GroupOffloadConfig": "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
    **dict.fromkeys(("Medium", "OffloadingEvent", "OffloadingKVEventsConfig", "make_offload_key"),
                    "vllm.v1.kv_offload.base"),
}


@functools.cache
def _first_use() -> None:
    """vLLM's hash of the first block's parent, set once before anything hashes."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    utils.init_none_hash(importlib.import_module("vllm.utils.hashing").sha256)


def __getattr__(name: str):
    if name not in NAMES and name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _first_use()
    if name in MODULES:
        return importlib.import_module(MODULES[name])
    return getattr(importlib.import_module(NAMES[name]), name)

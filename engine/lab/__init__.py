"""The cache lab: what-if replay of real request traces through the real cache manager, miss
ratio curves, the Belady-optimal and infinite-cache ceilings, and dead cache. Torch- and Qt-free.

- `traces`: Mooncake and Qwen-Bailian trace files -> prefix-chained requests.
- `whatif`: replay a trace through `KVCacheManager` (sequential or timed mode).
- `ceilings`: the LRU miss-ratio curve in one pass, Belady's optimum, the infinite cache.
- `dead`: cached blocks that no lookup can reach any more.
"""

"""Tools that drive an `Engine` or a `KVCacheManager` to answer questions about the KV cache:
the what-if cache lab over real request traces, the textbook's claims measured (`experiments`),
workloads (`workload`) and KV memory arithmetic (`capacity`). Never imports `sessions` or `app`
(they sit above it).

- `traces`: Mooncake and Qwen-Bailian trace files -> prefix-chained requests.
- `whatif`: replay a trace through `KVCacheManager` (sequential or timed mode).
- `routing`: the same across R replicas under a router (round-robin ... prefix-aware).
- `ceilings`: the LRU miss-ratio curve in one pass, Belady's optimum, the infinite cache.
- `residency`, `report`: how long blocks stay, the lab's table and sizing advice.
"""

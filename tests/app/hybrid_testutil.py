"""A hybrid pool for the window's tests: a real KVCacheManager with a full-attention group and a
sliding window of 8 tokens (block size 4), driven until some blocks left the window."""

from __future__ import annotations

from kvscope.app.frames import RequestRow
from kvscope.engine import KVCacheManager
from kvscope.engine.kv_groups import NULL, KVGroup

BS, W = 4, 8
GROUPS = (KVGroup(), KVGroup(window=W, layers=(1, 3)))
A = list(range(100, 132))  # 32 tokens: 8 blocks in each group


def hybrid_scenario(num_blocks: int = 64, others: int = 1) -> KVCacheManager:
    """#0 (A, then 3 decode tokens): its window table starts with 6 nulls, their blocks cached.
    #1 (A's first 16 tokens and one more) hits 4 full-attention blocks, of which the window
    group needs only the last 2 (nulls before them). `others` requests more, each freed after
    its prefill (their blocks cached in both groups)."""
    mgr = KVCacheManager(num_blocks, BS, groups=GROUPS)
    assert mgr.admit(0, A) == 0
    for step, token in enumerate((7, 8, 9), start=1):
        mgr.begin_step(step)
        mgr.append_token_ids(0, [token])
        mgr.allocate(0, 1)
    mgr.begin_step(4)
    assert mgr.admit(1, A[:16] + [999]) == 16
    for rid in range(2, 2 + others):
        mgr.admit(rid, list(range(1000 * rid, 1000 * rid + 20)))
        mgr.free(rid)
    full, window = mgr.block_tables(0)
    assert window[:6] == [NULL] * 6 and NULL not in full
    return mgr


def hybrid_rows(mgr: KVCacheManager) -> list[RequestRow]:
    return [RequestRow.new(0, "decode", 32, output_tokens=3),
            RequestRow.new(1, "prefill", 17, cached_tokens=16)]

"""What one run checks: the GPU's shapes, a quicker GPU subset, or tiny ones for the CPU dry
run."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 16


@dataclass
class Plan:
    """Shapes of one run: the GPU's, a quicker GPU subset, or tiny ones for the CPU dry run."""

    layouts: list[tuple[str, int, int, int]]  # name, query heads, KV heads, head_dim
    decode: list[tuple[int, int]]             # batch, longest context
    prefill: list[tuple[int, int]]            # (context incl. new tokens, new tokens) per seq
    store_tokens: int
    overflow: tuple[int, int]                 # batch x context: past 2^31 cache elements
    bandwidth: list[tuple[int, int]]          # context, batch; the last is the target case
    sweep: list[tuple]                        # (num_splits, BLOCK_N, num_warps) at the target
    timing_iters: int
    model: dict                               # transformers.LlamaConfig fields
    prompt_lens: list[int]
    max_tokens: int
    chunk_tokens: int                         # token budget per step of the chunked engine run

    @staticmethod
    def make(dry: bool, quick: bool) -> Plan:
        llama_8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rms_norm_eps=1e-5, max_position_embeddings=131072)
        if dry:
            return Plan([("GQA 4/2 d64", 4, 2, 64), ("MQA 2/1 d128", 2, 1, 128)],
                        [(1, 70), (3, 40)], [(40, 20), (9, 9), (5, 1)], 24, (2, 40),
                        [(32, 1), (32, 2)], [(2, 32, 4)], 1,
                        dict(vocab_size=320, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             rms_norm_eps=1e-5, max_position_embeddings=512),
                        [40, 9, 3], 5, 16)
        layouts = [("GQA 32/8 d128", 32, 8, 128), ("GQA 9/3 d64", 9, 3, 64),
                   ("MQA 16/1 d128", 16, 1, 128)]
        if quick:
            return Plan(layouts[:2], [(1, 8192), (16, 4096)], [(8192, 256), (700, 700), (17, 1)],
                        2048, (64, 32768), [(8192, 16), (32768, 16)], [(8, 32, 4), (32, 32, 4)],
                        10,
                        llama_8b,
                        [500, 37, 5], 16, 128)
        return Plan(layouts, [(1, 32768), (16, 8192), (64, 2048)],
                    [(32768, 512), (8192, 2048), (1500, 1500), (17, 1)], 4096, (64, 32768),
                    [(8192, 1), (8192, 16), (8192, 64), (32768, 1), (32768, 64), (32768, 16)],
                    [(s, n, w) for s in (8, 32) for n in (32, 64) for w in (4, 8)], 20, llama_8b,
                    [600, 300, 37, 5], 24, 128)

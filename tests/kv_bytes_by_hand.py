"""KV bytes per token worked out by hand for two model shapes and every format: the numbers
the format helper, the capacity panel and the capacity experiment are checked against."""

# Bytes per token by hand: (layers, KV heads, head_dim) and, per format, the sum written out:
# per layer 2 (K, V) x heads x head_dim x bytes + scales (float32 per token and head: 4 B per
# side), KIVI (G = 16): K payload + K float16 scale and zero per channel over 16 tokens
# (heads x head_dim x 4 / 16) + V float16 scale and zero per token (heads x 4).
HAND = {
    (30, 3, 64): {"bfloat16": 30 * 2 * 3 * 64 * 2, "float32": 46080, "fp8": 11520,
                  "fp8_per_head": 11520, "int8_per_token_head": 30 * 2 * 3 * (64 + 4),
                  "int4_per_token_head": 30 * 2 * 3 * (32 + 4),
                  "kivi4": 30 * (2 * 3 * 32 + 3 * 64 * 4 // 16 + 3 * 4),
                  "kivi2": 30 * (2 * 3 * 16 + 48 + 12)},
    (32, 8, 128): {"bfloat16": 131072, "float32": 262144, "fp8": 65536, "fp8_per_head": 65536,
                   "int8_per_token_head": 32 * 2 * 8 * 132, "int4_per_token_head": 32 * 16 * 68,
                   "kivi4": 32 * (1024 + 256 + 32), "kivi2": 32 * (512 + 256 + 32)},
}
HAND_VALUES = {(30, 3, 64): [23040, 46080, 11520, 11520, 12240, 6480, 7560, 4680],
               (32, 8, 128): [131072, 262144, 65536, 65536, 67584, 34816, 41984, 25600]}

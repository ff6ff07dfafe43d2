"""kvscope's GGUF header reader and torch dequantization against `gguf`'s own reader and numpy
dequantization, on files written by `gguf`'s writer: the same fields, the same tensor bytes, and
bit-identical float32 weights (tolerance: none)."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_testutil import encode

from kvscope.engine.models.gguf import dequantize
from kvscope.engine.models.gguf_header import read_header

TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)


def write(path, endianess=gguf.GGUFEndian.LITTLE):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_string("general.name", "héllo 日本")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("x.big", -2**40)
    w.add_float64("x.double", 0.1)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "", "naïve", "🙂"] * 50)
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 4] * 50)
    w.add_array("x.floats", [0.5, -1.25])
    w.add_array("x.bools", [True, False, True])
    for qtype in TYPES:
        x = rng.standard_normal((8, 512)).astype(np.float32)
        w.add_tensor(f"t.{qtype.name}", encode(x, qtype, rng), raw_dtype=qtype)
    w.add_tensor("t.vector", rng.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fields_and_tensors_equal_ggufs_own_reader(tmp_path, endian):
    path = write(tmp_path / "m.gguf", endian)
    ref, ours = gguf.GGUFReader(path), read_header(path)
    assert ours.data_offset == ref.data_offset
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts)
            continue
        mine = ours.fields[key]
        assert (mine.tolist() if isinstance(mine, np.ndarray) else mine) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.data.tobytes() == np.ascontiguousarray(theirs.data).tobytes(), mine.name


def test_dequantized_weights_are_bit_identical_to_ggufs(tmp_path):
    path = write(tmp_path / "m.gguf")
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for tensor in read_header(path).tensors:
        theirs = gguf.dequantize(ref[tensor.name].data, tensor.tensor_type)
        mine = dequantize(tensor).numpy()
        assert mine.shape == tensor.shape == theirs.shape, tensor.name
        assert mine.dtype == np.float32
        assert np.array_equal(mine.view(np.uint32), theirs.astype(np.float32).view(np.uint32)), \
            tensor.name


@pytest.mark.parametrize("cut", [3, 40, 500, -100])
def test_a_cut_or_foreign_file_raises(tmp_path, cut):
    data = write(tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises((ValueError, struct.error)):
        read_header(bad)

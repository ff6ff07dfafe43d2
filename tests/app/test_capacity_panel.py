"""The Capacity panel shows the textbook numbers: read back from its labels, table and plot."""

from __future__ import annotations

import json

import numpy as np
import pytest
from image_compare import ARTIFACTS, to_array
from kv_bytes_by_hand import HAND
from PySide6.QtCore import Qt

from kvscope.app.panels.capacity_panel import KIND_COLORS, CapacityPanel
from kvscope.lab.capacity import FORMATS, GIB, format_bytes

# config.json files as Hugging Face ships them (meta-llama/Llama-3.1-8B-Instruct and -70B-).
ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": ROPE, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 28672,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": ROPE, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
SIZE = (640, 400)


@pytest.fixture
def panel(qtbot):
    p = CapacityPanel()
    qtbot.addWidget(p)
    p.resize(*SIZE)
    p.show()
    p.memory_box.setValue(60.0)
    return p


def table(p: CapacityPanel) -> list[list[str]]:
    return [[p.table.item(r, c).text() for c in range(p.table.columnCount())]
            for r in range(p.table.rowCount())]


def model_row(p: CapacityPanel, precision: str) -> list[str]:
    return next(r for r in table(p) if "(model)" in r[0] and r[1] == precision)


def test_llama_8b_numbers_in_the_labels_and_table(panel):
    assert panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    assert panel.bytes_per_token_label.text() == "131,072 B = 128 KiB"
    assert panel.tokens_fit_label.text() == "491,520 tokens"  # 60 GiB / 128 KiB
    assert model_row(panel, "16-bit")[2:5] == ["128 KiB", "–", "491,520"]
    assert "GQA 8 KV" in model_row(panel, "16-bit")[0]
    assert "131,072" in panel.bytes_per_token_label.toolTip()
    assert "2 (K and V) × 32 layers × 8 KV heads × 128 head_dim × 2 B" in \
        panel.bytes_per_token_label.toolTip()


def test_70b_gqa_numbers_at_32k_context(panel):
    panel.set_model_config(LLAMA_31_70B, "Llama 3.1 70B")
    panel.prompt_box.setValue(30_720)
    panel.output_box.setValue(2_048)
    assert panel.context_tokens == 32_768
    assert panel.bytes_per_token_label.text() == "327,680 B = 320 KiB"
    assert panel.bytes_per_request_label.text() == "10 GiB (10.74 GB)"
    assert "10,737,418,240" in panel.bytes_per_request_label.toolTip()
    assert panel.requests_fit_label.text() == "6 × 32,768 tokens"
    assert model_row(panel, "16-bit")[2:] == ["320 KiB", "–", "196,608", "6", "1.00×"]
    assert model_row(panel, "fp8")[2:] == ["160 KiB", "–", "393,216", "12", "2.00×"]


def test_every_format_then_the_other_layouts_in_the_chosen_one(panel):
    panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    formats = ["fp32", "16-bit", "fp8", "fp8_per_head", "int8_per_token_head",
               "int4_per_token_head", "kivi4", "kivi2"]
    assert [(r[0], r[1]) for r in table(panel)] == [
        *(("GQA 8 KV (model)", f) for f in formats), ("MHA 32 KV", "16-bit"),
        ("MQA 1 KV", "16-bit")]
    assert [r.bytes_per_token for r in panel.rows][-2:] == [524288, 16384]
    panel.dtype_box.setCurrentText("fp8")
    assert panel.bytes_per_token_label.text() == "65,536 B = 64 KiB"
    assert panel.tokens_fit_label.text() == "983,040 tokens"
    assert panel.vs_16_label.text() == "2.00× the tokens"
    rows = table(panel)
    assert [(r[0], r[1], r[6]) for r in rows[-2:]] == [("MHA 32 KV", "fp8", "2.00×"),
                                                       ("MQA 1 KV", "fp8", "2.00×")]
    tokens = [int(rows[i][4].replace(",", "")) for i in (8, 2, 9)]  # MHA, GQA, MQA in fp8
    assert tokens[0] < tokens[1] < tokens[2]
    bold = [r for r in range(panel.table.rowCount()) if panel.table.item(r, 0).font().bold()]
    assert bold == [2]  # the chosen format's row of the model's layout
    for r in range(panel.table.rowCount()):
        for c in range(panel.table.columnCount()):
            assert panel.table.item(r, c).toolTip(), f"cell {r},{c} has no tooltip"


SMOLLM2_135M = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "hidden_size": 576, "torch_dtype": "bfloat16", "max_position_embeddings": 8192}


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA_31_8B])
def test_every_formats_bytes_are_the_hand_numbers(panel, config):
    """The shapes (30 layers, 3 KV heads, d 64) and (32, 8, 128) whose bytes per token are worked
    out by hand in kv_bytes_by_hand: the table and the labels show them, in every format."""
    panel.set_model_config(config, "a model")
    s = panel.shape
    hand = HAND[s.num_layers, s.num_kv_heads, s.head_dim]
    residual = s.num_layers * 15 * s.num_kv_heads * s.head_dim * 2  # bf16 K of 15 tokens
    mem, ctx = panel.memory_bytes, panel.context_tokens
    for i, (label, fmt) in enumerate(FORMATS):
        cells = table(panel)[i]
        assert cells[1] == label
        assert f"= {hand[fmt]:,} B" in panel.table.item(i, 2).toolTip(), fmt
        res = residual if fmt.startswith("kivi") else 0
        assert cells[4] == f"{(mem - res) // hand[fmt]:,}", fmt
        assert cells[5] == f"{mem // (ctx * hand[fmt] + res):,}", fmt
        assert cells[6] == f"{((mem - res) // hand[fmt]) / (mem // hand['bfloat16']):.2f}×"
        panel.dtype_box.setCurrentText(label)
        assert panel.bytes_per_token_label.text().startswith(f"{hand[fmt]:,} B = "), fmt
        assert panel.tokens_fit_label.text() == f"{cells[4]} tokens"
        assert ("residual" in panel.bytes_per_request_label.text()) == bool(res)
        if res:
            assert cells[3] == format_bytes(res)
            assert f"+ {res:,} B of KIVI's residual" in panel.bytes_per_request_label.toolTip()
    if s.num_layers == 30:  # kivi2, by part, as the hand sum: 30 x (2 x 3 x 16 + 48 + 12)
        assert "30 layers × (data 96 B + scales and zeros 60 B)" in panel.table.item(7, 2).toolTip()


def test_invalid_config_shows_an_error_and_keeps_the_numbers(panel, qtbot, tmp_path):
    panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    before = (panel.bytes_per_token_label.text(), table(panel))
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 32,')
    with qtbot.waitSignal(panel.error_occurred) as signal:
        assert not panel.load_config_path(bad)
    assert "not valid JSON" in signal.args[0]
    assert panel.error_label.isVisible()
    assert "not valid JSON" in panel.error_label.text()
    assert "Still showing Llama 3.1 8B" in panel.error_label.text()
    assert (panel.bytes_per_token_label.text(), table(panel)) == before

    assert not panel.set_model_config({"hidden_size": 4096}, "half a config")
    assert "lacks num_hidden_layers" in panel.error_label.text()
    assert not panel.load_config_path(tmp_path / "nowhere" / "config.json")
    assert "cannot read" in panel.error_label.text()
    assert (panel.bytes_per_token_label.text(), table(panel)) == before
    assert panel.preset_box.currentText() == "Llama 3.1 8B"

    good = tmp_path / "llama70b" / "config.json"
    good.parent.mkdir()
    good.write_text(json.dumps(LLAMA_31_70B))
    assert panel.load_config_path(good)
    assert not panel.error_label.isVisible()
    assert panel.preset_box.currentText() == "llama70b/config.json"
    assert panel.bytes_per_token_label.text() == "327,680 B = 320 KiB"


def test_plot_has_one_curve_per_variant_and_the_memory_line(panel):
    panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    assert list(panel.curves) == ["MHA 32 KV", "GQA 8 KV (model)", "MQA 1 KV"]
    for curve, bpt in zip(panel.curves.values(), (524288, 131072, 16384), strict=True):
        x, y = curve.getData()
        assert y[-1] == pytest.approx(x[-1] * bpt / GIB)
    assert panel.memory_line.value() == pytest.approx(60.0)
    assert panel.context_line.value() == panel.context_tokens
    mha = dict(LLAMA_31_8B, num_key_value_heads=32)
    panel.set_model_config(mha, "an MHA model")
    assert list(panel.curves) == ["MHA 32 KV (model)", "MQA 1 KV"]
    assert len(panel.plot.plotItem.listDataItems()) == 2


def test_the_engines_model_config_and_cache_dtype(panel):
    from kvscope.engine.models.config import ModelConfig

    demo = ModelConfig.from_hf_dict(LLAMA_31_8B)
    assert panel.set_model_config(demo, "demo", cache_dtype="torch.float32")
    assert panel.dtype_box.currentText() == "fp32"
    assert "engine cache float32" in panel.source_label.text()
    assert panel.bytes_per_token_label.text() == "262,144 B = 256 KiB"
    assert panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    assert panel.dtype_box.currentText() == "16-bit"
    assert panel.set_model_config(demo, "demo", cache_dtype="int4_per_token_head")
    assert panel.dtype_box.currentText() == "int4_per_token_head"
    assert "engine cache int4_per_token_head" in panel.source_label.text()
    assert panel.bytes_per_token_label.text() == "34,816 B = 34 KiB"


def test_presets_and_a_narrow_dock(panel, qtbot):
    panel.preset_box.setCurrentText("70B GQA (Llama 3.1 70B)")
    assert panel.bytes_per_token_label.text() == "327,680 B = 320 KiB"
    panel.resize(380, 700)
    qtbot.waitUntil(lambda: panel.splitter.orientation() == Qt.Vertical)


def test_screenshot(panel, qtbot):
    panel.set_model_config(LLAMA_31_8B, "Llama 3.1 8B")
    qtbot.wait(50)
    image = panel.grab().toImage()
    assert (image.width(), image.height()) == SIZE
    ARTIFACTS.mkdir(exist_ok=True)
    image.save(str(ARTIFACTS / "capacity_panel.png"))
    plot = to_array(panel.plot.grab().toImage()).astype(int)
    for kind, color in KIND_COLORS.items():  # every layout's line is drawn in its colour
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(plot - rgb).max(axis=2) < 30).sum() > 50, f"no {kind} line"

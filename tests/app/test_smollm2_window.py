"""The model drop-down's real model: SmolLM2 loads in the engine process and the capacity tab
shows its real sizes (built from the GGUF metadata, there is no config.json)."""

from __future__ import annotations

from PySide6.QtCore import QSettings

from kvscope.app.main_window import MainWindow


def test_choosing_smollm2_in_the_drop_down_loads_the_real_model(qtbot, tmp_path):
    w = MainWindow(settings=QSettings(str(tmp_path / "kvscope.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.blocks_box.setValue(64)
    w.show()
    w.model_box.setCurrentIndex(w.model_box.findText("SmolLM2-135M-Instruct (real)"))
    w.reload()
    qtbot.waitUntil(lambda: w.engine is not None or w.banner.isVisible(), timeout=120_000)
    assert w.engine is not None, w.banner.label.text()
    assert w.engine.model_name == "SmolLM2-135M-Instruct"
    assert w.engine.model_config["num_hidden_layers"] == 30
    # 30 layers x K and V x 3 kv heads x 64 dims x 4 bytes (float32 cache)
    assert w.engine.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    assert w.capacity.bytes_per_token_label.text().startswith(f"{30 * 2 * 3 * 64 * 4:,} B")
    w.close()

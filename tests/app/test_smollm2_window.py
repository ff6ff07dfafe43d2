"""The model drop-down's real model: SmolLM2 loads in the engine process, the capacity tab shows
its real sizes (built from the GGUF metadata, there is no config.json), and the composer chats:
the second turn resends the first and its answer, which come back from the cache."""

from __future__ import annotations

from PySide6.QtCore import QSettings

from kvscope.app.window.main_window import MainWindow

BS = 16


def ask(w, qtbot, text: str):
    """Send a chat turn and wait for its answer; return the turn's request row."""
    turns = len(w.composer.messages)
    w.composer.prompt.setPlainText(text)
    w.composer.submit_button.click()
    qtbot.waitUntil(lambda: len(w.composer.messages) == turns + 2, timeout=120_000)
    return max(w.requests.model.rows, key=lambda r: r.request_id)


def test_smollm2_from_the_drop_down_loads_and_chats(qtbot, tmp_path):
    w = MainWindow(settings=QSettings(str(tmp_path / "kvscope.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.blocks_box.setValue(64)
    w.block_size_box.setValue(BS)
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

    w.composer.chat.setChecked(True)
    w.composer.max_tokens.setValue(8)
    first = ask(w, qtbot, "What is the capital of France?")
    second = ask(w, qtbot, "And of Italy?")
    assert [m["role"] for m in w.composer.messages] == ["user", "assistant"] * 2
    assert w.composer.messages[1]["content"] == first.text != ""
    assert first.prompt_tokens > 20  # SmolLM2's template adds its system prompt
    # The second turn's prompt starts with the first turn and its answer: all of its full
    # blocks with KV (every token but the last sampled one) are hits.
    assert second.cached_tokens == (first.prompt_tokens + first.output_tokens - 1) // BS * BS
    assert "assistant: " + first.text in w.composer.transcript.toPlainText()
    w.close()


def test_chat_on_a_model_without_a_template_is_refused_and_keeps_the_text(window, qtbot):
    assert not window.composer.chat.isEnabled()  # the box is off on the demo model; set anyway
    window.composer.chat.setChecked(True)
    window.composer.prompt.setPlainText("Hello?")
    window.composer.submit_button.click()
    assert window.composer.prompt.toPlainText() == ""  # sent
    qtbot.waitUntil(window.banner.isVisible, timeout=20_000)
    assert window.banner.label.text() == ("Not queued: this model has no chat template "
                                          "(SmolLM2-135M-Instruct has one)")  # no class, no flag
    assert window.composer.prompt.toPlainText() == "Hello?" and window.composer.messages == []

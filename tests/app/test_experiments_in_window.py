"""In the window: an experiment measured while recording is kept in the recording, and replaying
that session shows it in the Experiments dock."""

from __future__ import annotations

from kvscope.engine import SamplingParams
from kvscope.sessions import SessionReader


def test_an_experiment_run_while_recording_replays_with_the_session(window, qtbot, tmp_path):
    assert window.docks["experiments"].widget() is window.experiments
    path = tmp_path / "with-experiment.kvscope"
    window.start_recording(str(path))
    qtbot.waitUntil(lambda: window.recording_path == str(path), timeout=5000)
    window.submit("Hello there", SamplingParams(max_tokens=3), None)
    qtbot.waitUntil(lambda: any(r.state.startswith("finished") for r in
                                window.requests.model.rows), timeout=20_000)
    panel = window.experiments
    panel.quick = True
    panel.choice.setCurrentText("warm-up")
    with qtbot.waitSignal(panel.finished, timeout=90_000) as done:
        panel.start()
    measured = done.args[0]
    window.toggle_recording()
    qtbot.waitUntil(lambda: window.recording_path is None, timeout=20_000)
    with SessionReader(path) as reader:
        assert [r.verdict for r in reader.experiments()] == [measured.verdict]
    panel.table.setRowCount(0)
    panel.result = None
    assert window.open_session(str(path))
    assert panel.result.verdict == measured.verdict and panel.table.rowCount() == 6

"""`kvscope experiment`: the list, a run on the demo model writing CSV, PNG and the session,
and bad input as one line with exit status 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from kvscope.app.cli.main import main
from kvscope.lab.experiments import EXPERIMENTS
from kvscope.sessions import SessionReader

OLD = Path(__file__).resolve().parents[1] / "data" / "session_before_step_stream.kvscope"


def test_list_names_every_experiment(capsys):
    assert main(["experiment", "--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["naive-vs-cached", "prompt-length", "output-length", "warm-prefix",
                     "warm-up", "capacity", "fp8", "kv-formats", "block-size",
                     "offload", "prompt-cache-ttl"] == list(EXPERIMENTS)


def test_a_run_prints_its_table_and_verdict_and_writes_csv_png_and_session(tmp_path, capsys):
    session = tmp_path / "s.kvscope"
    session.write_bytes(OLD.read_bytes())
    out_csv, out_png = tmp_path / "r.csv", tmp_path / "r.png"
    assert main(["experiment", "block-size", "--quick", "--csv", str(out_csv), "--png",
                 str(out_png), "--session", str(session)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("block-size: Block size trades hit granularity")
    assert lines[1].split()[:2] == ["block", "size"]
    assert lines[-1].startswith("verdict: 2 requests sharing a 40-token prefix reused 80 tokens")
    rows = list(csv.reader(out_csv.open()))
    assert rows[0][:2] == ["block size", "hit tokens"]
    assert [r[0] for r in rows[1:]] == ["8", "16", "32", "64"]
    image = QImage(str(out_png))
    assert image.width() == 900 and len({image.pixel(x, image.height() // 2)
                                         for x in range(image.width())}) > 2
    with SessionReader(session) as s:
        (saved,) = s.experiments()
    assert saved.name == "block-size" and saved.verdict in lines[-1]


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown experiment 'nope'; one of: naive-vs-cached"),
    ([], "name an experiment"),
    (["fp8", "--quick", "--csv", "/no/such/folder/r.csv"], "folder /no/such/folder does not"),
    (["fp8", "--quick", "--model", "/no/such/model"], "model folder not found"),
    (["fp8", "--quick", "--session", "/no/such.kvscope"], "no such session file"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["experiment", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("kvscope: error: ")

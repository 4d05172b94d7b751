"""`rlasync plot`: the panels render from a recorded metrics file (the README quickstart's, logging every step);
missing metrics leave a panel empty with a note; a step written twice is drawn once."""

import json
import shutil
from pathlib import Path

import pytest

from rlasync import cli
from rlasync.plot import PANELS, load_metrics, missing_metrics, plot_run, series_points

pytest.importorskip("matplotlib")

RECORDED = Path(__file__).parent / "data" / "quickstart_metrics.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_recorded_quickstart_renders_every_panel(tmp_path):
    run = tmp_path / "quickstart"
    run.mkdir()
    shutil.copy(RECORDED, run / "metrics.jsonl")
    records = load_metrics(run)
    assert len(records) >= 10 and [r["step"] for r in records] == sorted({r["step"] for r in records})
    path, notes = plot_run(run)
    assert path == run / "metrics.png" and _png_size(path) == (1080, 900)
    # the quickstart logs every key of the reward, step time, queue, packing and log-prob panels
    for panel in PANELS[:5]:
        assert missing_metrics(records, panel) == [], panel.title
    assert notes == ["throughput: not logged: rollout/generated_tok_s"]  # distillation's name for it


def test_missing_metrics_leave_the_panel_empty_with_a_note(tmp_path):
    rows = [{"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.4}, {"step": 2, "reward": 0.5}, "not json"]
    file = tmp_path / "metrics.jsonl"
    file.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))
    assert series_points(load_metrics(file), "reward") == ([1, 2], [0.2, 0.5])  # the re-written step 2 once, the last
    path, notes = plot_run(file, tmp_path / "out" / "p.png")
    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC
    assert "reward: not logged: frac_zero_std_groups" in notes
    assert "packing: not logged: batch/packing_ratio, batch/row_fill_frac" in notes


def test_cli_plot(tmp_path, capsys):
    shutil.copy(RECORDED, tmp_path / "metrics.jsonl")
    out = tmp_path / "fig.png"
    assert cli.main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:8] == PNG_MAGIC
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["plot", str(tmp_path / "empty")]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_an_evaluation_record_joins_its_step_and_a_rerun_replaces_it(tmp_path):
    lines = [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2, "loss": 1.0},
        {"step": 2, "eval/reward": 0.5},  # the evaluation of step 2, logged when it arrived
        {"step": 2, "reward": 0.3},  # a re-run of step 2 replaces the step (its evaluation too)
        {"step": 4, "eval/reward": 0.6},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    records = load_metrics(tmp_path)
    assert records == [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}, {"step": 4, "eval/reward": 0.6}]
    lines.pop(3)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    assert load_metrics(tmp_path)[1] == {"step": 2, "reward": 0.2, "loss": 1.0, "eval/reward": 0.5}

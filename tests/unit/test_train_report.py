"""Report from a canned run directory; metrics reading; straggler detection; re-weighting;
Chrome trace format."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.train.metrics import (RANK_FIELDS, MetricsWriter, StragglerDetector, read_metrics,
                                    rebalance_weights, summarize_ranks)
from hpctrain.train.report import ReportError, make_report, summarize
from hpctrain.train.timeline import Timeline, chrome_trace


def canned_run(run_dir: Path, steps: int = 60, ranks: int = 3, slow_rank: int = 2) -> None:
    w = MetricsWriter(run_dir / "metrics.jsonl")
    for s in range(1, steps + 1):
        times = []
        for r in range(ranks):
            busy = 0.010 * (1.6 if r == slow_rank else 1.0)
            comm = 0.017 - busy if r != slow_rank else 0.001
            times.append([busy + comm, 0.001, 0.003, busy - 0.004, comm, 0.001, 300.0 + r, 50.0 + r, -1.0, -1.0])
        rec = {"kind": "train", "step": s, "epoch": (s - 1) // 20, "loss": 2.3 * math.exp(-s / 15) + 0.05,
               "lr": 0.01, "samples": 96.0, "time": s * 0.02}
        rec.update({name: times[0][j] for j, name in enumerate(RANK_FIELDS)})
        rec["compute"] = rec["forward"] + rec["backward"]
        rec["samples_per_s"] = 96.0 / max(t[0] for t in times)
        rec.update(summarize_ranks(times))
        w.write(rec)
        if s % 20 == 0:
            w.write({"kind": "eval", "step": s, "epoch": (s - 1) // 20, "test_loss": 1.0 / s,
                     "test_accuracy": 0.8 + s / 400, "test_samples": 301,
                     "test_confusion_matrix": [[100, 3, 1], [2, 95, 4], [0, 6, 90]]})
    w.write({"kind": "event", "step": 30, "what": "straggler", "rank": slow_rank, "busy": 0.016, "median": 0.01,
             "slower_by": 0.6})
    w.write({"kind": "event", "step": 40, "what": "rebalance", "weights": [1.1, 1.1, 0.8], "batch_sizes": [35, 35, 26]})
    w.close()
    (run_dir / "summary.json").write_text(json.dumps({"result": {"status": "completed", "checkpoint": "ck.pt",
                                                                 "wall_s": 12.5}}))


def test_report_writes_readable_pngs_and_summary(tmp_path):
    canned_run(tmp_path)
    rep = make_report(tmp_path)
    names = sorted(Path(p).name for p in rep["files"])
    assert names == ["compute_comm.png", "confusion.png", "loss.png", "rank_step_time.png", "resources.png",
                     "summary.txt", "throughput.png"]
    for p in rep["files"]:
        data = Path(p).read_bytes()
        if p.endswith(".png"):
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    text = rep["text"]
    assert "status: completed; 60 steps, 3 epoch(s), 3 rank(s)" in text
    assert "test accuracy: 0.9500" in text
    assert "stragglers: rank 2" in text
    assert "re-balanced 1 time(s)" in text
    assert "rank 2: step" in text and "last checkpoint: ck.pt" in text
    s = rep["summary"]
    assert s["per_rank"]["comm"][2] < s["per_rank"]["comm"][0]  # the straggler waits least


def test_report_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        make_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="no training steps"):
        make_report(tmp_path)


def test_report_cli(tmp_path, capsys):
    from hpctrain.cli.main import main

    canned_run(tmp_path, ranks=1, slow_rank=-1)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "1 rank(s)" in out and (tmp_path / "plots" / "loss.png").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_report_leaves_the_callers_matplotlib_alone(tmp_path):
    """No matplotlib.use() and no pyplot: a user's backend, rcParams and figures survive."""
    canned_run(tmp_path)
    code = (
        "import matplotlib, sys\n"
        "matplotlib.use('svg')\n"
        "size = matplotlib.rcParams['font.size']\n"
        "from hpctrain.train.report import make_report\n"
        "make_report(sys.argv[1])\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "assert matplotlib.rcParams['font.size'] == size and not matplotlib.rcParams['axes.grid']\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "report" / "loss.png").is_file()


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    from hpctrain.cli.main import main
    from hpctrain.extras import MissingExtraError

    canned_run(tmp_path, ranks=1, slow_rank=-1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import finds when it is not installed
    with pytest.raises(MissingExtraError, match=r"needs matplotlib.*HINT: pip install 'hpctrain\[report\]'"):
        make_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain report: ") and "pip install 'hpctrain[report]'" in err


def test_read_metrics_ignores_torn_line_and_keeps_redone_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": 1, "loss": 3.0}, {"kind": "train", "step": 2, "loss": 2.0},
             {"kind": "event", "step": 1, "what": "resume"}, {"kind": "train", "step": 2, "loss": 1.5}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "train", "st')
    recs = read_metrics(p)
    train = [r for r in recs if r["kind"] == "train"]
    assert [(r["step"], r["loss"]) for r in train] == [(1, 3.0), (2, 1.5)]
    assert summarize(recs)["final_loss"] == 1.5


def test_straggler_needs_patience_and_reports_once():
    d = StragglerDetector(threshold=0.2, patience=3)
    assert d.update([1.0, 1.0, 1.5]) == []
    assert d.update([1.0, 1.0, 1.5]) == []
    rep = d.update([1.0, 1.0, 1.5])
    assert [r["rank"] for r in rep] == [2] and rep[0]["slower_by"] == pytest.approx(0.5)
    assert d.update([1.0, 1.0, 1.5]) == []  # reported once
    assert d.update([1.0, 1.0, 1.1]) == []  # recovered (within 20 %)
    for _ in range(2):
        assert d.update([1.0, 1.0, 1.5]) == []
    assert [r["rank"] for r in d.update([1.0, 1.0, 1.5])] == [2]  # a new episode


def test_straggler_noise_is_not_reported():
    d = StragglerDetector(threshold=0.2, patience=2)
    for i in range(20):
        assert d.update([1.0 + 0.1 * ((i + r) % 2) for r in range(4)]) == []
    assert StragglerDetector().update([5.0]) == []


def test_rebalance_weights():
    w = rebalance_weights([100.0, 100.0, 50.0])
    assert w == pytest.approx([1.2, 1.2, 0.6])
    assert rebalance_weights([100.0, 101.0]) is None  # noise: keep the plan
    assert rebalance_weights([100.0, 100.0, 50.0], previous=w) is None  # no change
    assert rebalance_weights([100.0, 0.0]) is None  # no measurement
    floor = rebalance_weights([1000.0, 1.0])
    assert floor[1] > 0.04  # never starved


def test_chrome_trace_format():
    tl = Timeline(rank=1, max_steps=2)
    tl.start_clock()
    tl.add("forward", tl.t0 + 0.001, tl.t0 + 0.003)
    tl.step = 2
    tl.add("forward", tl.t0 + 0.004, tl.t0 + 0.005)  # beyond max_steps: dropped
    tl.add("allreduce bucket.0", tl.t0 + 0.002, tl.t0 + 0.004, tid=2, step=1, bytes=64)
    trace = chrome_trace([[], tl.events])
    json.dumps(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 2 and all(e["pid"] == 1 for e in xs)
    assert xs[0]["ts"] == pytest.approx(1000, abs=1) and xs[0]["dur"] == pytest.approx(2000, abs=1)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1"]

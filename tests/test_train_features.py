"""The runner's keys for real projects, end to end at 2 ranks: a user loss and metric file,
exact F1 / confusion matrix, bf16, clipping, input normalisation kept across a resume, early
stopping with the best checkpoint, per-rank resource fields; and the wine example."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import clirun
from mpirun import ROOT, mpi_env, python_argv, run_mpi

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from sklearn.datasets import load_digits

    from hpctrain.data.pack import pack

    base = tmp_path_factory.mktemp("features")
    d = load_digits()
    x = d.data.astype(np.float32) * 10 + 100     # far from zero mean, unit scale: normalisation matters
    np.savez(base / "train.npz", x=x[:900], y=d.target[:900].astype(np.int64))
    np.savez(base / "test.npz", x=x[900:1200], y=d.target[900:1200].astype(np.int64))
    pack([str(base / "train.npz")], str(base / "train.h5"), quiet=True)
    pack([str(base / "test.npz")], str(base / "test.h5"), quiet=True)
    meta = np.stack([x[:, :8].mean(1), x[:, 56:].mean(1)], axis=1).astype(np.float32)
    np.savez(base / "two.npz", image=x[:900] / 200, meta=meta[:900] / 200, y=d.target[:900].astype(np.int64))
    pack([str(base / "two.npz")], str(base / "two.h5"), quiet=True)
    (base / "two.py").write_text(
        "import torch\n"
        "class Two(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(64, 10), torch.nn.Linear(2, 10)\n"
        "    def forward(self, image, meta):\n"
        "        return self.a(image) + self.b(meta)\n"
        "def net():\n"
        "    return Two()\n")
    (base / "mine.py").write_text(
        "import torch\n"
        "def loss(out, y):\n"
        "    return torch.nn.functional.cross_entropy(out, y.long(), reduction='none')\n"
        "def hits(out, y):\n"
        "    return (out.argmax(1) == y).float()\n")
    return base


def config(base, run_dir, extra=""):
    path = base / f"{run_dir.name}.yaml"
    path.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [32]}}}}
loss: mine.py:loss
data: {{train: [train.h5], test: [test.h5], normalize: standard}}
optimizer: {{name: adam, lr: 0.003}}
batch_size: 16
steps: 60
precision: bf16
clip_grad_norm: 1.0
eval: {{interval_steps: 20, metrics: [accuracy, f1, precision, recall, confusion_matrix, "mine.py:hits", loss]}}
checkpoint: {{interval_steps: 20, keep: 2, keep_best: f1}}
monitor_interval: 0.2
run_dir: "{run_dir}"
quiet: true
threads: 1
{extra}
""")
    return path


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_user_loss_metrics_bf16_clip_normalize_best_and_resume(data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(data, run_dir, "debug: {stop_at_step: 40}")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    r = run_mpi(2, [*HPCTRAIN, "train", str(config(data, run_dir)), "--resume", "auto"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    recs = records(run_dir)
    evals = [e for e in recs if e["kind"] == "eval"]
    last = evals[-1]
    # normalisation makes this shifted data learnable in 60 steps; without it the MLP sits near chance
    assert last["test_accuracy"] > 0.8, last
    cm = np.array(last["test_confusion_matrix"])
    assert cm.sum() == last["test_samples"] == 300
    assert np.trace(cm) / cm.sum() == pytest.approx(last["test_accuracy"])
    assert last["test_hits"] == pytest.approx(last["test_accuracy"])
    assert 0 < last["test_f1"] <= 1 and len(last["test_confusion_matrix"]) == 10
    train = [t for t in recs if t["kind"] == "train"]
    assert all(len(t["rank_cpu_percent"]) == 2 and len(t["rank_gpu_util"]) == 2 for t in train)
    assert max(max(t["rank_cpu_percent"]) for t in train) > 0
    # the checkpoint carries the statistics; the resumed half used them (loaded, not recomputed)
    state = torch.load(run_dir / "checkpoints" / "ckpt-000000060.pt", weights_only=True)
    norm = state["extra"]["normalize"]
    x = np.load(data / "train.npz")["x"]
    assert norm["kind"] == "standard"
    assert np.allclose(norm["mean"].numpy(), x.mean(0), atol=1e-3)
    # a constant feature keeps scale 1 (it maps to 0) instead of a division by zero
    assert np.allclose(norm["std"].numpy(), np.where(x.std(0) > 1e-6, x.std(0), 1.0), atol=1e-3)
    assert (run_dir / "checkpoints" / "ckpt-best.pt").exists()
    assert any(e.get("what") == "best_checkpoint" for e in recs)


def test_early_stopping_stops_every_rank_with_a_checkpoint(data, tmp_path):
    run_dir = tmp_path / "stop"
    cfg = config(data, run_dir, "early_stopping: {metric: loss, patience: 1, min_delta: 100}\ntensorboard: true")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "early stopping: loss did not improve" in r.stdout
    stop = [e for e in records(run_dir) if e.get("what") == "early_stop"]
    assert stop and stop[0]["step"] == 40          # evals at 20 (best) and 40 (no improvement of 100)
    assert (run_dir / "checkpoints" / "ckpt-000000040.pt").exists()
    # TensorBoard scalars (the 'tensorboard' extra): train, eval and per-rank resource tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/cpu_percent", "eval/test_f1"} <= tags, tags


@pytest.mark.parametrize("extra,says", [
    ("eval: {metrics: [f2]}", "'f2' is not one of"),
    ("early_stopping: {metric: r2}", "'r2' is watched"),
    ("loss: {name: cross_entropy, label_smoothing: 2}", "label_smoothing"),
    ("precision: fp8", "precision"),
])
def test_dry_run_rejects_bad_new_keys(data, tmp_path, extra, says):
    cfg = config(data, tmp_path / "dry", extra)
    r = clirun.hpctrain(["train", str(cfg), "--dry-run"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr


def test_wine_example_reaches_095_on_2_ranks(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "wine.py"), "--ranks", "2"], capture_output=True,
                       text=True, env=mpi_env(), cwd=str(ROOT), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("wine:")][-1]
    acc = float(line.split("test accuracy ")[1].split(",")[0])
    assert acc >= 0.95, line


def test_several_inputs_reach_the_forward_in_order(data, tmp_path):
    run_dir = tmp_path / "two"
    cfg = data / "two.yaml"
    cfg.write_text(f"""
model: {{factory: two.py:net}}
data: {{train: [two.h5], test: [two.h5], keys: {{x: [image, meta], y: y}}}}
optimizer: {{name: adam, lr: 0.01}}
batch_size: 16
steps: 40
eval: {{metrics: [accuracy]}}
run_dir: "{run_dir}"
quiet: true
threads: 1
""")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    evals = [e for e in records(run_dir) if e["kind"] == "eval"]
    assert evals and evals[-1]["test_accuracy"] > 0.5
    r = clirun.hpctrain(["train", str(cfg), "--dry-run", "--set", "data.normalize=standard"])
    assert r.returncode == 2 and "data.normalize applies to one input" in r.stderr

"""`hpctrain export` and `hpctrain.load_model`: a run trained on 2 ranks, exported as a plain
state_dict and TorchScript, loaded back three ways with the same predictions."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import clirun
from mpirun import ROOT, mpi_env, python_argv, run_mpi
from test_train_cli import write_config

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")
# One xdist group: the module's tests share one training run (the fixture), which a split
# across workers would run on each.
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("export")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A digits MLP trained for 40 steps on 2 ranks; its test inputs."""
    from hpctrain.data.pack import pack
    from sklearn.datasets import load_digits

    base = tmp_path_factory.mktemp("export")
    d = load_digits()
    np.savez(base / "train.npz", x=d.data[:900].astype(np.float32), y=d.target[:900].astype(np.int64))
    np.savez(base / "test.npz", x=d.data[900:1200].astype(np.float32), y=d.target[900:1200].astype(np.int64))
    pack([str(base / "train.npz")], str(base / "train.h5"), quiet=True)
    pack([str(base / "test.npz")], str(base / "test.h5"), quiet=True)
    run_dir = base / "run"
    cfg = write_config(base / "c.yaml", base, run_dir, "checkpoint: {interval_steps: 20}")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    return run_dir, torch.from_numpy(d.data[900:1200].astype(np.float32)), d.target[900:1200]


def cli(*args, cwd=None):
    if cwd is None:  # export starts no MPI: in this process, without a new interpreter's start-up
        return clirun.hpctrain(args)
    return subprocess.run([*HPCTRAIN, *args], capture_output=True, text=True, timeout=180, env=mpi_env(),
                          cwd=str(cwd))


def test_export_state_dict_and_torchscript_agree_with_load_model(trained, tmp_path):
    import hpctrain
    from hpctrain.train.models import mlp

    run_dir, x, y = trained
    out = tmp_path / "model.pt"
    r = cli("export", str(run_dir), "-o", str(out), "--torchscript", "--torch-export")
    assert r.returncode == 0, r.stderr
    assert "ckpt-000000040.pt (step 40)" in r.stderr, r.stderr
    ts = tmp_path / "model.torchscript.pt"
    assert f"torchscript: {ts}" in r.stdout and not (tmp_path / "model.normalize.pt").exists()

    model = hpctrain.load_model(run_dir)
    assert not model.training
    with torch.no_grad():
        expected = model(x)
    assert (expected.argmax(1).numpy() == y).mean() > 0.8  # it did learn: these are the trained weights

    weights = torch.load(str(out), weights_only=True)  # tensors only
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    fresh = mlp(hidden=[32], input_scale=0.0625)
    fresh.load_state_dict(weights)
    fresh.eval()
    scripted = torch.jit.load(str(ts))
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    assert f"torch.export program: {tmp_path / 'model.pt2'}" in r.stdout
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(scripted(x), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(program(x), expected, rtol=1e-6, atol=1e-6)  # batch size is dynamic


def test_checkpoint_option_picks_that_file(trained, tmp_path):
    import hpctrain

    run_dir, x, _ = trained
    first = run_dir / "checkpoints" / "ckpt-000000020.pt"
    assert first.is_file()
    r = cli("export", str(run_dir), "--checkpoint", str(first), "-o", str(tmp_path / "m20.pt"))
    assert r.returncode == 0 and "(step 20)" in r.stderr, r.stderr
    w20 = torch.load(str(tmp_path / "m20.pt"), weights_only=True)
    m20 = hpctrain.load_model(run_dir, checkpoint=first)
    newest = hpctrain.load_model(run_dir)
    assert all(torch.equal(w20[k], v) for k, v in m20.state_dict().items())
    assert not all(torch.equal(w20[k], v) for k, v in newest.state_dict().items())


def test_best_needs_a_best_checkpoint(trained, tmp_path):
    import hpctrain
    from hpctrain.train.export import ExportError

    run_dir, _, _ = trained
    r = cli("export", str(run_dir), "--best", "-o", str(tmp_path / "b.pt"))
    assert r.returncode == 2, r
    assert "no best checkpoint (a file with 'best' in its name)" in r.stderr and "HINT: train with" in r.stderr
    # a copy of the step-20 checkpoint as the best one: --best takes it
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.copy(copy / "checkpoints" / "ckpt-000000020.pt", copy / "checkpoints" / "best-accuracy.pt")
    r = cli("export", str(copy), "--best", "-o", str(tmp_path / "b.pt"))
    assert r.returncode == 0 and "best-accuracy.pt (step 20)" in r.stderr, r.stderr
    best = hpctrain.load_model(copy, best=True)
    w20 = hpctrain.load_model(run_dir, checkpoint=run_dir / "checkpoints" / "ckpt-000000020.pt")
    assert all(torch.equal(best.state_dict()[k], v) for k, v in w20.state_dict().items())
    with pytest.raises(ExportError, match="does not exist"):
        hpctrain.load_model(tmp_path / "nowhere")


def test_import_hpctrain_stays_light():
    code = "import sys, hpctrain; assert 'torch' not in sys.modules; f = hpctrain.load_model; " \
           "assert 'torch' in sys.modules; print(f.__module__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "hpctrain.train.export", r.stderr

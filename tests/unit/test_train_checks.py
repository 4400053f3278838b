"""Pre-flight checks of a training run (hpctrain.train.checks, hpctrain.data.labels) and the
launcher's choice of rank processes: pure, no MPI."""
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from hpctrain.cli.launch import rank_processes
from hpctrain.data.labels import LabelSummary, label_summary, merge, summarize_array
from hpctrain.train import checks
from hpctrain.train.checkpoint import CheckpointError
from hpctrain.train.config import ConfigError
from hpctrain.train.models import mlp


def factory(width: int, depth: int = 2, *, act: str = "relu"):
    return torch.nn.Linear(width, depth)


def test_unknown_kwarg_names_factory_kwarg_and_parameters():
    msg = checks.kwargs_error(factory, "m.py:factory", {"widht": 3})
    assert "'widht' not accepted by model.factory 'm.py:factory'" in msg
    assert "it takes (width, depth=2, act='relu')" in msg and "HINT: did you mean 'width'?" in msg
    with pytest.raises(ConfigError, match="widht"):
        checks.build_model(factory, "m.py:factory", {"widht": 3})


def test_misspelled_factory_name_suggests_the_close_ones():
    from hpctrain.train import models

    assert checks.callable_hint(models, "mpl") == "\nHINT: did you mean 'mlp'?"
    assert checks.callable_hint(models, "zzzz").startswith("\nHINT: its callables: ")


def test_missing_required_kwarg_and_kwargs_catch_all():
    assert "missing a required argument: 'width'" in checks.kwargs_error(factory, "f", {"depth": 3})
    assert checks.kwargs_error(factory, "f", {"width": 3, "act": "tanh"}) is None
    assert checks.kwargs_error(lambda **kw: kw, "f", {"anything": 1}) is None


def test_value_the_factory_rejects_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        checks.build_model(mlp, "hpctrain.train.models:mlp", {"hidden": 3})
    text = str(err.value)
    assert "rejected model.kwargs {'hidden': 3}: TypeError" in text and "hidden=(128, 64)" in text
    assert "\nHINT:" in text


def test_width_mismatch_says_both_numbers():
    model = mlp(in_features=32, hidden=[8])
    with pytest.raises(ConfigError) as err:
        checks.probe_model(model, "hpctrain.train.models:mlp", "x", (64,), torch.float32, ["in_features"])
    text = str(err.value)
    assert "shape (64,) = 64 features" in text and "expects in_features=32" in text
    assert "HINT: set model.kwargs.in_features to match the data (64 features per sample)" in text
    assert model.training  # the probe restores train mode


def test_probe_returns_output_and_leaves_batchnorm_statistics_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    before = model[1].running_mean.clone()
    out = checks.probe_model(model, "f", "x", (4,), torch.float32)
    assert out.shape == (2, 3) and torch.equal(model[1].running_mean, before)


def test_labels_out_of_range_negative_fractional_and_ok():
    s = summarize_array(np.array([1, 4, 10, 3]), "a.h5", 100)
    msg = checks.label_error(s, 10, "y", ["num_classes"])
    assert "range from 1 to 10 but the model has 10 outputs (classes 0..9): label 10 at row 102 of a.h5" in msg
    assert "HINT: set model.kwargs.num_classes: 11" in msg
    neg = checks.label_error(summarize_array(np.array([0, -1]), "b.h5"), 10, "y")
    assert "label -1 at row 1 of b.h5" in neg and "start at 0" in neg
    frac = checks.label_error(summarize_array(np.array([1.0, 2.5, 3.0], np.float32), "c.h5"), 10, "y")
    assert "1 value(s) that are not class indices, e.g. 2.5 at row 1 of c.h5" in frac and "truncate" in frac
    assert checks.label_error(summarize_array(np.array([0.0, 9.0]), "d.h5"), 10, "y") is None
    assert checks.label_error(summarize_array(np.array([0, 9]), "d.h5"), 10, "y") is None
    assert summarize_array(np.zeros((0,), np.int64)).count == 0
    assert summarize_array(np.array(4)).high == 4
    nan = summarize_array(np.array([np.nan, 1.0]), "e.h5")
    assert nan.fractional == 1 and nan.low == nan.high == 1.0


def test_merge_keeps_extremes_positions_and_first_example():
    a = summarize_array(np.array([3, 5]), "a", 0)
    b = summarize_array(np.array([-2, 9]), "b", 10)
    m = merge([LabelSummary(), a, b])
    assert (m.count, m.low, m.high, m.low_at, m.high_at) == (4, -2, 9, ("b", 10), ("b", 11))


def test_label_summary_reads_each_part_once(tmp_path):
    path = str(tmp_path / "l.h5")
    y = np.arange(10)
    with h5py.File(path, "w") as f:
        f["y"] = y
    parts = [label_summary([path], "y", r, 3) for r in range(3)]
    assert sum(p.count for p in parts) == 10
    m = merge(parts)
    assert (m.low, m.high, m.high_at) == (0, 9, (path, 9))


def test_check_data_fits_model_combines_every_rank(tmp_path):
    path = str(tmp_path / "d.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((8, 6), np.float32)
        f["y"] = np.array([0, 1, 2, 3, 0, 1, 2, 7])
    cfg = SimpleNamespace(data=SimpleNamespace(keys={"x": "x", "y": "y"}, dtypes={}, train=[path], test=[]),
                          model=SimpleNamespace(factory="hpctrain.train.models:mlp"), loss="cross_entropy")
    model = mlp(in_features=6, hidden=[4], num_classes=5)
    # rank 0's half of the labels is fine; rank 1's holds the 7: both ranks must fail alike
    halves = [label_summary([path], "y", r, 2) for r in range(2)]
    assert checks.label_error(halves[0], 5, "y") is None
    for rank in range(2):
        with pytest.raises(ConfigError, match="label 7 at row 7"):
            checks.check_data_fits_model(cfg, model, mlp, rank, 2, lambda mine: halves)
    checks.check_data_fits_model(cfg, mlp(in_features=6, hidden=[4], num_classes=8), mlp)
    cfg.loss = "mse"
    checks.check_data_fits_model(cfg, model, mlp)  # regression targets: no label check


def test_state_dict_mismatch_lists_a_few_of_each():
    model = mlp(in_features=4, hidden=[3, 3])
    other = mlp(in_features=4, hidden=[5])
    msg = checks.state_dict_mismatch(model.state_dict(), other.state_dict(), limit=1)
    assert "missing 2: 6.weight (+1 more)" in msg
    assert "shape differs for 4 (checkpoint vs model): 2.weight (5, 4) vs (3, 4) (+3 more)" in msg
    extra = dict(model.state_dict(), surplus=torch.zeros(1))
    assert checks.state_dict_mismatch(model.state_dict(), extra) == "unexpected 1: surplus"
    assert checks.state_dict_mismatch(model.state_dict(), model.state_dict()) is None
    with pytest.raises(CheckpointError) as err:
        checks.load_model_state(model, other.state_dict(), "ck.pt", {"factory": "f:g", "kwargs": {"hidden": [5]}})
    assert "checkpoint ck.pt does not fit this model (it was written by model.factory 'f:g'" in str(err.value)
    assert "HINT:" in str(err.value)


def test_missing_optional_package_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match="tensorboard: true needs the tensorboard package"):
        checks.check_optional_packages(SimpleNamespace(tensorboard=True))
    checks.check_optional_packages(SimpleNamespace(tensorboard=False))


@pytest.mark.parametrize("tree, expected", [
    # Open MPI on one node: prterun starts the ranks; a rank's data worker is not a rank
    ({11: (10, "python"), 12: (10, "python"), 13: (12, "python")}, [11, 12]),
    # MPICH: mpiexec.hydra -> hydra_pmi_proxy -> ranks
    ({11: (10, "hydra_pmi_proxy"), 12: (11, "python3"), 13: (11, "python3")}, [12, 13]),
    # prterun with a local daemon
    ({11: (10, "prted"), 12: (11, "hpctrain"), 14: (10, "hpctrain")}, [12, 14]),
    ({}, []),
])
def test_rank_processes(tree, expected):
    assert rank_processes(tree, 10) == expected

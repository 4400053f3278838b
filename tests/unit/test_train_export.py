"""hpctrain.train.export on hand-made checkpoints: input normalisation stored in a checkpoint
is applied by load_model and kept by the TorchScript export; bad entries are clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.train import checkpoint as ckpt
from hpctrain.train.export import (ExportError, Normalized, NormalizedInputs, export, load_model, normalization,
                                   read_checkpoint, to_torchscript, with_normalization)
from hpctrain.train.models import mlp

KWARGS = {"in_features": 3, "hidden": [5], "num_classes": 2}


def make_run(tmp_path: Path, normalize=None, in_extra: bool = False, name: str = "ckpt-000000007.pt") -> Path:
    torch.manual_seed(0)
    model = mlp(**KWARGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"normalize": normalize} if in_extra and normalize is not None else {}
    state = ckpt.build_state(step=7, epoch=0, step_in_epoch=7, model=model, optimizer=opt, scheduler=None,
                             rng=[ckpt.capture_rng()], extra=extra,
                             config={"model": {"factory": "hpctrain.train.models:mlp", "kwargs": KWARGS}})
    if normalize is not None and not in_extra:
        state["normalize"] = normalize
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    ckpt.atomic_save(state, run / "checkpoints" / name)
    return run


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, -1.0, 0.5]])


@pytest.mark.parametrize("in_extra", [False, True])
def test_standard_normalisation_is_applied(tmp_path, in_extra):
    mean, std = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([2.0, 4.0, 0.5])
    run = make_run(tmp_path, {"kind": "standard", "mean": mean, "std": std}, in_extra=in_extra)
    model = load_model(run)
    assert isinstance(model, Normalized) and not model.training
    bare = read_checkpoint(run / "checkpoints" / "ckpt-000000007.pt")
    plain = mlp(**KWARGS)
    plain.load_state_dict(bare.weights)
    with torch.no_grad():
        torch.testing.assert_close(model(X), plain((X - mean) / std))
        assert not torch.allclose(model(X), plain(X))


def test_minmax_and_constant_feature(tmp_path):
    lo, hi = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([10.0, 1.0, 4.0])  # feature 1 is constant
    shift, scale = normalization({"min": lo, "max": hi})
    assert torch.equal(shift, lo) and torch.equal(scale, torch.tensor([10.0, 1.0, 2.0]))
    run = make_run(tmp_path, {"min": lo.tolist(), "max": hi.tolist()})
    model = load_model(run)
    with torch.no_grad():
        torch.testing.assert_close(model(X), model.model((X - lo) / torch.tensor([10.0, 1.0, 2.0])))
        assert torch.isfinite(model(X)).all()


def test_no_normalisation_gives_the_bare_model(tmp_path):
    assert isinstance(load_model(make_run(tmp_path)), nn.Sequential)
    assert isinstance(load_model(make_run(tmp_path, {"kind": "none"})), nn.Sequential)


def test_several_inputs_each_their_own():
    class Two(nn.Module):
        def forward(self, a, b):
            return a + 10 * b

    stats = [{"mean": torch.tensor([1.0]), "std": torch.tensor([2.0])}, None]
    wrapped = with_normalization(Two(), stats)
    assert isinstance(wrapped, NormalizedInputs)
    out = wrapped(torch.tensor([5.0]), torch.tensor([3.0]))
    assert torch.equal(out, torch.tensor([2.0 + 30.0]))


def test_bad_normalisation_entry_is_one_clear_error(tmp_path):
    run = make_run(tmp_path, {"average": [1.0, 2.0, 3.0]})
    with pytest.raises(ExportError, match=r"'normalize' has keys \['average'\]; expected mean and std, or min and max"):
        load_model(run)


def test_export_writes_bare_state_dict_normalisation_beside_and_torchscript(tmp_path):
    mean, std = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([2.0, 4.0, 0.5])
    run = make_run(tmp_path, {"mean": mean, "std": std})
    done = export(run, tmp_path / "out" / "m.pt", torchscript=tmp_path / "out" / "m.ts")
    assert done.step == 7 and done.normalize == tmp_path / "out" / "m.normalize.pt"
    weights = torch.load(str(done.state_dict), weights_only=True)
    fresh = mlp(**KWARGS)
    fresh.load_state_dict(weights)  # the bare model's keys
    norm = torch.load(str(done.normalize), weights_only=True)
    assert torch.equal(norm["shift"], mean) and torch.equal(norm["scale"], std)
    scripted = torch.jit.load(str(done.torchscript))
    with torch.no_grad():
        torch.testing.assert_close(scripted(X), fresh.eval()((X - mean) / std))
        torch.testing.assert_close(scripted(X), load_model(run)(X))


def test_exported_program_keeps_the_normalisation_and_a_dynamic_batch(tmp_path):
    from hpctrain.train.export import to_exported_program

    mean, std = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([2.0, 4.0, 0.5])
    model = load_model(make_run(tmp_path, {"mean": mean, "std": std}))
    torch.export.save(to_exported_program(model, torch.zeros(2, 3)), str(tmp_path / "m.pt2"))
    loaded = torch.export.load(str(tmp_path / "m.pt2")).module()
    x = torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_unscriptable_model_is_traced_with_the_sample_input():
    class Loose(nn.Module):
        def forward(self, x, *rest):  # *args: torch.jit.script refuses it
            return x * 2

    traced = to_torchscript(Loose(), lambda: torch.ones(2, 3))
    assert torch.equal(traced(X), X * 2)
    with pytest.raises(ExportError, match="cannot be scripted .* no sample input"):
        to_torchscript(Loose(), lambda: None)


def test_weights_that_do_not_fit_the_factory(tmp_path):
    run = make_run(tmp_path)
    path = run / "checkpoints" / "ckpt-000000007.pt"
    state = torch.load(str(path), weights_only=True)
    state["config"]["model"]["kwargs"] = {**KWARGS, "hidden": [6]}
    torch.save(state, str(path))
    with pytest.raises(ExportError, match="do not fit hpctrain.train.models:mlp .*\nHINT"):
        load_model(run)


def test_not_a_checkpoint(tmp_path):
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ExportError, match="cannot be loaded with weights_only=True"):
        load_model(tmp_path, checkpoint=bad)
    with pytest.raises(ExportError, match="no checkpoint that loads in .*\nHINT"):
        load_model(tmp_path)


def test_pipeline_checkpoint_is_merged_into_one_model(tmp_path):
    """A pipeline-<step>/ directory (meta.pt + one file per stage) loads as the whole model."""
    from hpctrain.parallel.checkpoint import FORMAT, stage_checkpoint_path
    from hpctrain.train import pipeline as pp

    torch.manual_seed(1)
    model = mlp(**KWARGS)  # Flatten, Scale, Linear '2', ReLU, Linear '4'
    weights = model.state_dict()
    directory = tmp_path / "run" / "checkpoints" / pp.checkpoint_name(9)
    directory.mkdir(parents=True)
    for stage, prefix in enumerate(("2.", "4.")):
        state = {"format": FORMAT, "stage": stage, "stages": 2, "layers": [], "split_points": [3], "num_layers": 5,
                 "state_dict": {k: v for k, v in weights.items() if k.startswith(prefix)}, "optimizer": None,
                 "extra": {}}
        torch.save(state, stage_checkpoint_path(str(directory), stage, 2))
    torch.save({"format": pp.META_FORMAT, "step": 9, "stages": 2, "split_points": [3], "extra": {},
                "config": {"model": {"factory": "hpctrain.train.models:mlp", "kwargs": KWARGS}}},
               str(directory / pp.META_NAME))
    loaded = load_model(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(loaded(X), model.eval()(X), rtol=0, atol=0)
    assert read_checkpoint(directory).step == 9

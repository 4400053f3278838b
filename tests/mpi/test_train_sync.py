"""The runner's sync points under a real mpiexec, with a BatchNorm model and unequal per-rank
batches (``data.policy: weighted`` with ``data.weights``):

- ``model_average``: the final weights and BatchNorm buffers equal the sample-weighted mean of
  every rank's own local-SGD model, computed here by training each rank's share alone;
- ``sync.buffers``: every rank holds the same buffers at each evaluation and checkpoint
  (``average``, ``broadcast``), and a stopped-and-resumed run evaluates like the
  uninterrupted one;
- user callbacks (``callbacks: [file.py:Class]``) see every hook point on every rank.
"""
import json

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.config import load_config
from hpctrain.train.trainer import Trainer

from digits_files import pack_digits, shared_dir  # noqa: E402

RANKS = (2,)
TIMEOUT = 400

comm.init()
N, R = comm.size(), comm.rank()
torch.set_num_threads(1)
BASE = shared_dir("hpctrain-sync-test-")
WEIGHTS = [3.0, 1.0][:N] if N > 1 else [1.0]

MODEL_FILE = '''
import torch
from torch import nn


def bn_mlp(hidden=16):
    return nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))
'''

CALLBACK_FILE = '''
import json

import torch

from hpctrain import comm
from hpctrain.train.callbacks import Callback


class Recorder(Callback):
    def __init__(self):
        self.events = []
        self.buffers = []

    def _buffers(self, loop):
        return [b.double().sum().item() for b in loop.run.model.buffers() if b.is_floating_point()]

    def on_fit_start(self, loop):
        self.events.append(["fit_start", loop.state.step])

    def on_step_end(self, loop):
        self.events.append(["step", loop.state.step])

    def on_eval_end(self, loop, results):
        self.events.append(["eval", loop.state.step, results["test_samples"]])
        self.buffers.append(self._buffers(loop))

    def on_checkpoint(self, loop, path):
        self.events.append(["checkpoint", loop.state.step])
        self.buffers.append(self._buffers(loop))

    def on_epoch_end(self, loop):
        self.events.append(["epoch_end", loop.state.epoch])

    def on_fit_end(self, loop, result):
        self.events.append(["fit_end", result.status])
        out = loop.run.run_dir / f"events-{comm.rank()}.json"
        out.write_text(json.dumps({"events": self.events, "buffers": self.buffers}))
'''


def _make_data() -> None:
    pack_digits(BASE, slice(0, 400), slice(400, 520), chunk_rows=32)
    if R == 0:
        (BASE / "bnmodel.py").write_text(MODEL_FILE)
        (BASE / "cbs.py").write_text(CALLBACK_FILE)
    comm.barrier()


_make_data()


def config(run: str, **extra):
    data = {
        "model": {"factory": str(BASE / "bnmodel.py") + ":bn_mlp"},
        "data": {"train": [str(BASE / "train.h5")], "test": [str(BASE / "test.h5")], "policy": "weighted",
                 "weights": WEIGHTS},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "lr_scaling": "none", "batch_size": 8, "steps": 6, "seed": 11, "quiet": True, "threads": 1,
        "run_dir": str(BASE / run), "timeline": False,
        "checkpoint": {"interval_steps": 4, "keep": 3}, "eval": {"interval_steps": 4, "batch_size": 16},
        "callbacks": [str(BASE / "cbs.py") + ":Recorder"],
    }
    for key, value in extra.items():
        node = data
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return load_config(data=data)


def final_state(run: str):
    found = ckpt.newest_valid(BASE / run / "checkpoints")
    assert found is not None
    return found[1]


def local_sgd(cfg, rank: int, steps: int):
    """Rank ``rank``'s model trained alone on its share (no merges): the same initial weights,
    the same batches, the runner's loss scaling (masked sum x data world / global batch)."""
    import importlib.util

    from hpctrain.data import HDF5Dataset
    from hpctrain.train.plan import make_plan

    spec = importlib.util.spec_from_file_location("bnmodel_ref", BASE / "bnmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(cfg.seed)
    model = mod.bn_mlp()
    model.train()
    plan = make_plan(cfg, [400], [120], N, 8, WEIGHTS)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr)
    ds = HDF5Dataset(cfg.data.train, keys=["x", "y"], batch_size=8, policy="weighted", weights=WEIGHTS,
                     seed=cfg.seed, shuffle=True, drop_last=True, rank=rank, world_size=N, driver=None)
    ds.set_epoch(0)
    it, seen = iter(ds), 0.0
    for _ in range(steps):
        b = next(it)
        mask = b["mask"].double()
        per = torch.nn.functional.cross_entropy(model(b["x"]), b["y"], reduction="none")
        opt.zero_grad()
        ((per * mask.to(per.dtype)).sum() * (N / plan.global_batch)).backward()
        opt.step()
        seen += float(mask.sum())
    ds.close()
    return model.state_dict(), seen


@pytest.mark.skipif(N < 2, reason="averaging needs two ranks")
def test_model_average_final_weights_are_the_sample_weighted_mean():
    # 3 steps, merge every 100: the only merge is the final one (3 % 100 != 0)
    cfg = config("avg", sync__strategy="model_average", sync__average_every=100, steps=3,
                 checkpoint__interval_steps=0, eval__interval_steps=0)
    res = Trainer(cfg).fit()
    assert res.status == "completed" and res.step == 3
    if R == 0:
        states, seen = zip(*(local_sgd(cfg, r, 3) for r in range(N)))
        assert seen[0] != seen[1], seen  # unequal batches: a step-weighted mean would differ
        got = final_state("avg")["model"]
        for k, v in got.items():
            if not v.is_floating_point():
                continue
            want = sum(s[k].double() * n for s, n in zip(states, seen)) / sum(seen)
            assert torch.allclose(v.double(), want, rtol=1e-5, atol=1e-6), k
        # where the ranks' models differ (not 0.bias: BatchNorm cancels its gradient), the
        # result is neither rank 0's model nor the plain (step-weighted) mean
        differ = [k for k in got if got[k].is_floating_point()
                  and not torch.allclose(states[0][k].double(), states[1][k].double(), rtol=1e-4, atol=1e-6)]
        assert {"1.running_mean", "1.running_var", "3.weight"} <= set(differ), differ
        for k in differ:
            plain = sum(s[k].double() for s in states) / N
            assert not torch.allclose(got[k].double(), states[0][k].double(), rtol=1e-5, atol=1e-6), k
            assert not torch.allclose(got[k].double(), plain, rtol=1e-5, atol=1e-6), k
    comm.barrier()


def _events(run: str):
    return json.loads((BASE / run / f"events-{R}.json").read_text())


def _same_on_every_rank(values) -> bool:
    everyone = comm.allgather_object(values)
    return all(np.allclose(everyone[0], other, rtol=1e-6, atol=0) for other in everyone[1:])


@pytest.mark.parametrize("mode", ["average", "broadcast", "none"])
def test_buffers_agree_at_every_eval_and_checkpoint(mode):
    Trainer(config(f"buf-{mode}", sync__buffers=mode)).fit()
    rec = _events(f"buf-{mode}")
    assert len(rec["buffers"]) == 4  # eval and checkpoint at steps 4 and 6
    same = _same_on_every_rank(rec["buffers"])
    assert same == (mode != "none" or N == 1)


def test_callback_sees_every_hook_point():
    rec = _events("buf-average")["events"]
    kinds = [e[0] for e in rec]
    assert kinds[0] == "fit_start" and rec[-1] == ["fit_end", "completed"]
    assert [e[1] for e in rec if e[0] == "step"] == [1, 2, 3, 4, 5, 6]
    assert [e[1] for e in rec if e[0] == "eval"] == [4, 6]
    assert all(e[2] == 120 for e in rec if e[0] == "eval")
    assert [e[1] for e in rec if e[0] == "checkpoint"] == [4, 6]
    # built-in hooks run first: the step's evaluation and checkpoint come before its step event
    i4 = rec.index(["step", 4])
    assert rec[i4 - 2][0] == "eval" and rec[i4 - 1] == ["checkpoint", 4]


def test_resumed_run_evaluates_like_the_uninterrupted_one():
    straight = Trainer(config("straight", steps=10)).fit()
    stopped = Trainer(config("split", steps=10, debug__stop_at_step=5)).fit()
    assert stopped.status == "stopped" and stopped.step == 5
    resumed = Trainer(config("split", steps=10), resume="auto").fit()
    assert resumed.step == 10
    a, b = final_state("straight"), final_state("split")
    for k in a["model"]:
        if a["model"][k].is_floating_point() and "running" not in k:
            assert torch.equal(a["model"][k], b["model"][k]), k  # weights: bit-identical
        else:  # buffers: the same mean, summed in another order
            assert torch.allclose(a["model"][k].double(), b["model"][k].double(), rtol=1e-6, atol=1e-7), k
    assert resumed.test_loss == pytest.approx(straight.test_loss, rel=1e-6)
    assert resumed.test_accuracy == straight.test_accuracy


def test_zz_cleanup():
    comm.barrier()
    if R == 0:
        import shutil

        shutil.rmtree(BASE, ignore_errors=True)

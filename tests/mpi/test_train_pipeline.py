"""`hpctrain train` with a parallel: section under a real mpiexec: S = 2 on 2 ranks and
DP = 2 × PP = 2 on 4 ranks, both schedules.

- the weights after K steps (merged from the per-stage checkpoint with the merge tool, loaded
  into the plain model) equal single-process training of the same model on the same global
  batches (fp32, ≤ 1e-5 relative);
- a run stopped after a per-stage checkpoint and resumed ends identical to an uninterrupted one;
- the loss of the last stage reaches rank 0's metrics;
- bad input (more stages than ranks, a world not divisible by the stages, a model that cannot be
  split) is a clear ConfigError on every rank, before any communication.
"""

import shutil

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.parallel import merge_stage_checkpoints
from hpctrain.train import pipeline as pp
from hpctrain.train.config import ConfigError, load_config
from hpctrain.train.metrics import read_metrics
from hpctrain.train.trainer import Trainer, per_sample_loss

from digits_files import pack_digits, shared_dir  # noqa: E402

RANKS = (2, 4)
TIMEOUT = 420

comm.init()
N, R = comm.size(), comm.rank()
S = 2
DP = N // S
torch.set_num_threads(1)
STEPS = 6
BATCH = 8  # per replica, cut into 4 micro-batches of 2 rows
KWARGS = {"in_features": 64, "hidden": [16, 12], "num_classes": 10, "input_scale": 0.0625}


BASE = shared_dir("hpctrain-pipeline-test-")


def _make_data() -> None:
    pack_digits(BASE, slice(0, 256), slice(256, 321), chunk_rows=32)  # test: 65 rows, padding in the last batch
    if R == 0:
        (BASE / "models.py").write_text(
            "import torch\n\n"
            "class Net(torch.nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.a = torch.nn.Linear(64, 10)\n\n"
            "    def forward(self, x):\n"
            "        return self.a(x)\n\n"
            "def not_sequential():\n"
            "    return Net()\n")
    comm.barrier()


@pytest.fixture(scope="module", autouse=True)
def shared_data():
    """The files every rank's tests read; removed by rank 0 once every rank is past the last test."""
    _make_data()
    yield
    comm.barrier()
    if R == 0:
        shutil.rmtree(BASE, ignore_errors=True)


def config(run: str, **extra):
    data = {
        "model": {"factory": "hpctrain.train.models:mlp", "kwargs": KWARGS},
        "data": {"train": [str(BASE / "train.h5")], "test": [str(BASE / "test.h5")]},
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9},
        "lr_scaling": "none",
        "parallel": {"pipeline_stages": S, "micro_batches": 4, "schedule": "1f1b"},
        "batch_size": BATCH, "steps": STEPS, "seed": 5, "quiet": True, "run_dir": str(BASE / run),
        "checkpoint": {"interval_steps": 3, "keep": 3}, "log_interval": 2, "threads": 1,
        "eval": {"interval_steps": 3, "batch_size": 16},
    }
    for key, value in extra.items():
        node = data
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return load_config(data=data)


def merged(run: str, step: int):
    path = BASE / run / "checkpoints" / pp.checkpoint_name(step)
    assert path.is_dir(), sorted(p.name for p in (BASE / run / "checkpoints").iterdir())
    return merge_stage_checkpoints(str(path))


def reference(cfg, dp=DP, steps=STEPS, passes=1):
    """One process: the same model, the same global batches (the replicas' batches together),
    the global batch-mean loss, plain torch.optim.SGD."""
    from hpctrain.data import HDF5Dataset
    from hpctrain.train.models import mlp

    torch.manual_seed(cfg.seed)
    model = mlp(**KWARGS)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum)
    loaders = []
    for d in range(dp):
        ds = HDF5Dataset(cfg.data.train, keys=["x", "y"], batch_size=BATCH, seed=cfg.seed, shuffle=True,
                         drop_last=True, rank=d, world_size=dp, driver=None)
        ds.set_epoch(0)
        loaders.append((ds, iter(ds)))
    for _ in range(steps):
        batches = [next(it) for _ in range(passes) for _, it in loaders]
        x = torch.cat([b["x"] for b in batches])
        y = torch.cat([b["y"] for b in batches])
        mask = torch.cat([b["mask"] for b in batches]).float()
        opt.zero_grad()
        ((per_sample_loss(cfg, model(x), y) * mask).sum() / len(x)).backward()
        opt.step()
    for ds, _ in loaders:
        ds.close()
    return model


def max_rel(state, model):
    worst = 0.0
    for k, ref in model.state_dict().items():
        worst = max(worst, float((state[k] - ref).abs().max() / ref.abs().max()))
    return worst


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_weights_equal_single_process_training(schedule):
    cfg = config(f"eq-{schedule}", parallel__schedule=schedule)
    result = Trainer(cfg).fit()
    assert result.status == "completed" and result.step == STEPS
    assert result.checkpoint.endswith(pp.checkpoint_name(STEPS))
    if R == 0:
        from hpctrain.train.models import mlp

        state = merged(f"eq-{schedule}", STEPS)
        plain = mlp(**KWARGS)
        plain.load_state_dict(state)  # the merge tool's output loads into the plain model
        rel = max_rel(state, reference(cfg))
        assert rel <= 1e-5, rel
    comm.barrier()


def test_accumulation_equals_the_bigger_batch():
    """sync.backward_passes_per_step = 2: two replica batches (2 × 4 micro-batches) per step."""
    cfg = config("acc", sync__backward_passes_per_step=2, steps=3)
    assert Trainer(cfg).fit().step == 3
    if R == 0:
        rel = max_rel(merged("acc", 3), reference(cfg, steps=3, passes=2))
        assert rel <= 1e-5, rel
    comm.barrier()


def test_loss_and_eval_reach_rank_0_metrics():
    if R == 0:
        recs = read_metrics(BASE / "eq-1f1b" / "metrics.jsonl")
        train = [r for r in recs if r["kind"] == "train"]
        evals = [r for r in recs if r["kind"] == "eval"]
        assert [r["step"] for r in train] == list(range(1, STEPS + 1))
        assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in train)
        assert all(r["samples"] == BATCH * DP for r in train)  # counted once per replica (last stage)
        assert [r["step"] for r in evals] == [3, 6]
        assert all(r["test_samples"] == 65 and 0 <= r["test_accuracy"] <= 1 for r in evals)
    comm.barrier()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_resume_from_stage_checkpoints_continues_identically(schedule):
    run = f"resume-{schedule}"
    stopped = Trainer(config(run, parallel__schedule=schedule, debug__stop_at_step=3)).fit()
    assert stopped.status == "stopped" and stopped.step == 3
    resumed = Trainer(config(run, parallel__schedule=schedule), resume="auto").fit()
    assert resumed.status == "completed" and resumed.step == STEPS
    if R == 0:
        whole = merged(f"eq-{schedule}", STEPS)
        again = merged(run, STEPS)
        for k in whole:
            assert torch.equal(whole[k], again[k]), f"{k} differs after resume"
    comm.barrier()


def test_four_stages_one_without_parameters():
    """S = 4 on 4 ranks: stage 0 holds only Flatten and Scale (no parameters)."""
    if N != 4:
        return
    cfg = config("s4", parallel__pipeline_stages=4, steps=3)
    result = Trainer(cfg).fit()
    assert result.status == "completed" and result.step == 3
    if R == 0:
        state = merged("s4", 3)
        rel = max_rel(state, reference(cfg, dp=1, steps=3))
        assert rel <= 1e-5, rel
    comm.barrier()


def test_fresh_start_over_pipeline_checkpoints_is_refused():
    with pytest.raises(Exception, match="already holds checkpoints"):
        Trainer(config("eq-1f1b")).fit()


def test_a_stage_file_that_fails_on_its_own_ranks_fails_every_rank():
    """Each rank reads only its stage's file: when stage 1's does not fit, the ranks of stage 0
    must get the same error instead of waiting for stage 1 in the first collective."""
    import shutil

    from hpctrain.train import checkpoint as ckpt

    target = BASE / "badstage" / "checkpoints" / pp.checkpoint_name(STEPS)
    if R == 0:
        shutil.copytree(BASE / "eq-1f1b" / "checkpoints" / pp.checkpoint_name(STEPS), target)
        stage1 = target / "stage-001-of-002.pt"
        torch.save({**torch.load(stage1, weights_only=True), "layers": ["not", "these"]}, stage1)
    comm.barrier()
    with pytest.raises(ckpt.CheckpointError, match=r"is stage 1 of 2 with layers \['not', 'these'\]"):
        Trainer(config("badstage"), resume=str(target)).fit()


def test_resume_with_other_stages_is_a_clear_error():
    if N < 4:
        return
    with pytest.raises(Exception, match="4 stages|pipeline of 2 stages"):
        Trainer(config("eq-1f1b", parallel__pipeline_stages=4), resume="auto").fit()


def test_more_stages_than_ranks():
    with pytest.raises(ConfigError, match=f"{N + 1} pipeline stages need at least {N + 1} ranks"):
        Trainer(config("bad1", parallel__pipeline_stages=N + 1)).fit()


def test_world_not_divisible_by_stages():
    if N < 4:
        return
    with pytest.raises(ConfigError, match="world size 4 is not divisible by the 3 pipeline stages"):
        Trainer(config("bad2", parallel__pipeline_stages=3)).fit()


def test_model_that_cannot_be_split():
    with pytest.raises(ConfigError, match="nn.Sequential or a list"):
        Trainer(config("bad3", model__factory=f"{BASE / 'models.py'}:not_sequential", model__kwargs={})).fit()
    with pytest.raises(ConfigError, match=r"split points \[7\] out of range"):
        Trainer(config("bad4", parallel__split_points=[7])).fit()
    if N >= 4:  # Flatten, Scale, Linear: 3 layers for 4 stages
        with pytest.raises(ConfigError, match="cannot split a model of 3 layer"):
            Trainer(config("bad4", model__kwargs={**KWARGS, "hidden": []}, parallel__pipeline_stages=4)).fit()
    with pytest.raises(ConfigError, match="cannot be cut into parallel.micro_batches=16"):
        Trainer(config("bad5", parallel__micro_batches=16)).fit()


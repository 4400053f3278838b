"""The training runner under a real mpiexec: bit-identical resume, timeline from every rank,
NaN stop/skip, straggler warning and re-balancing, exact evaluation."""
import json
import shutil

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.config import load_config
from hpctrain.train.metrics import read_metrics
from hpctrain.train.trainer import Trainer

from digits_files import pack_digits, shared_dir  # noqa: E402

RANKS = (2,)
TIMEOUT = 400

comm.init()
N, R = comm.size(), comm.rank()


BASE = shared_dir("hpctrain-train-test-")


def _make_data() -> None:
    pack_digits(BASE, slice(0, 1000), slice(1000, 1301), chunk_rows=64)  # test: 301 rows, not a multiple of anything
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
        "model": {"factory": "hpctrain.train.models:mlp",
                  "kwargs": {"hidden": [32], "input_scale": 0.0625, "dropout": 0.1}},
        "data": {"train": [str(BASE / "train.h5")], "test": [str(BASE / "test.h5")]},
        "optimizer": {"name": "adam", "lr": 0.003},
        "schedule": {"kind": "cosine", "warmup_steps": 3},
        "batch_size": 16, "steps": 24, "seed": 3, "quiet": True, "run_dir": str(BASE / run),
        "checkpoint": {"interval_steps": 5, "keep": 2}, "log_interval": 4, "threads": 1,
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


def assert_states_equal(a, b):
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weight {k} differs"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for name in sa[p]:
            va, vb = sa[p][name], sb[p][name]
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), f"optimizer state {p}.{name} differs"
    for ra, rb in zip(a["rng"], b["rng"]):
        assert torch.equal(ra["torch"], rb["torch"])


def test_resume_is_bit_identical():
    straight = Trainer(config("straight")).fit()
    assert straight.status == "completed" and straight.step == 24
    # k steps, stop (as a preemption would), resume to N: a stop inside an epoch (1000 samples /
    # (16 x N) batches per epoch), so the data position within the epoch matters too.
    stopped = Trainer(config("split", debug__stop_at_step=7)).fit()
    assert stopped.status == "stopped" and stopped.step == 7
    resumed = Trainer(config("split"), resume="auto").fit()
    assert resumed.status == "completed" and resumed.step == 24
    a, b = final_state("straight"), final_state("split")
    assert_states_equal(a, b)
    comm.barrier()


def test_checkpoint_contents_and_keep():
    steps = [s for s, _ in ckpt.list_checkpoints(BASE / "straight" / "checkpoints")]
    assert steps == [24, 20], steps  # interval 5, keep 2, plus the last step
    state = final_state("straight")
    assert state["world_size"] == N and len(state["rng"]) == N
    assert state["hpctrain_version"] and state["config"]["batch_size"] == 16
    assert {"epoch", "step_in_epoch"} <= set(state)
    # Every rank's RNG stream differs (dropout masks must not be identical across ranks).
    if N > 1:
        assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])


def test_refuses_fresh_start_over_old_checkpoints():
    with pytest.raises(ckpt.CheckpointError, match="already holds checkpoints"):
        Trainer(config("straight")).fit()


def test_timeline_has_every_rank_and_bucket_events():
    if R == 0:
        trace = json.loads((BASE / "straight" / "timeline.json").read_text())
        events = trace["traceEvents"]
        pids = {e["pid"] for e in events if e.get("ph") == "X"}
        assert pids == set(range(N)), pids
        for rank in range(N):
            names = {e["name"] for e in events if e.get("ph") == "X" and e["pid"] == rank}
            for needed in ("data-wait", "forward", "backward", "optimizer"):
                assert needed in names, (rank, names)
            assert any(n.startswith("allreduce") for n in names), names
        for e in events:
            if e["ph"] == "X":
                assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["tid"], int)
        meta = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
        assert [m["args"]["name"] for m in meta] == [f"rank {r}" for r in range(N)]
    comm.barrier()


def test_metrics_have_every_rank_and_exact_eval():
    if R == 0:
        recs = read_metrics(BASE / "straight" / "metrics.jsonl")
        train = [r for r in recs if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, 25))
        for r in train:
            assert len(r["rank_step_time"]) == N and len(r["rank_comm"]) == N
            for key in ("loss", "lr", "samples_per_s", "data_wait", "compute", "comm", "rss_mb"):
                assert key in r
            assert r["samples"] == 16 * N
        evals = [r for r in recs if r["kind"] == "eval"]
        assert evals and all(e["test_samples"] == 301 for e in evals)  # padding ignored, nothing lost
    comm.barrier()


def test_eval_matches_single_process_reference():
    res = Trainer(config("evalref", steps=3, timeline=False)).fit()
    state = final_state("evalref")
    from hpctrain.train.models import mlp

    model = mlp(hidden=[32], input_scale=0.0625, dropout=0.1)
    model.load_state_dict(state["model"])
    model.eval()
    d = np.load(BASE / "test.npz")
    with torch.no_grad():
        out = model(torch.from_numpy(d["x"]))
    acc = float((out.argmax(1) == torch.from_numpy(d["y"])).double().mean())
    loss = float(torch.nn.functional.cross_entropy(out.double(), torch.from_numpy(d["y"])))
    assert res.test_accuracy == pytest.approx(acc, abs=1e-12)
    assert res.test_loss == pytest.approx(loss, rel=1e-5)


def test_nan_stop_keeps_last_good_checkpoint():
    res = Trainer(config("nan", debug__nan_at_step=7, debug__nan_rank=N - 1)).fit()
    assert res.status == "nan" and res.step == 7
    assert "NaN/Inf at step 7" in res.message and f"rank(s) [{N - 1}]" in res.message
    found = ckpt.newest_valid(BASE / "nan" / "checkpoints")
    assert found is not None and found[1]["step"] == 5
    for t in found[1]["model"].values():
        assert torch.isfinite(t).all()


def test_nan_skip_continues():
    res = Trainer(config("nanskip", on_nan="skip", debug__nan_at_step=4, debug__nan_rank=0)).fit()
    assert res.status == "completed" and res.step == 24
    state = final_state("nanskip")
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    if R == 0:
        events = [r for r in read_metrics(BASE / "nanskip" / "metrics.jsonl") if r["kind"] == "event"]
        assert any(e["what"] == "nan_skip" and e["step"] == 4 for e in events)
    comm.barrier()


@pytest.mark.skipif(N < 2, reason="stragglers need two ranks")
def test_straggler_warning_and_rebalance(caplog):
    caplog.set_level("WARNING", logger="hpctrain.train")
    res = Trainer(config("straggle", steps=0, epochs=3, batch_size=25, balance="auto", log_interval=2,
                         straggler_patience=2, debug__slow_rank=1, debug__slow_ms=40.0,
                         checkpoint__enabled=False, timeline=False)).fit()
    assert res.status == "completed"
    if R == 0:
        events = [r for r in read_metrics(BASE / "straggle" / "metrics.jsonl") if r["kind"] == "event"]
        assert any(e["what"] == "straggler" and e["rank"] == 1 for e in events), events
        rebal = [e for e in events if e["what"] == "rebalance"]
        assert rebal, events
        w = rebal[0]["weights"]
        assert w[1] < w[0], w  # the slow rank gets the smaller share
        assert any("straggler: rank 1" in m for m in caplog.messages)
    comm.barrier()


def test_resume_from_a_missing_or_bad_path_is_a_clear_error():
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint"):
        Trainer(config("badresume"), resume=str(BASE / "nope.pt")).fit()
    bad = BASE / "garbage.pt"
    if R == 0:
        bad.write_bytes(b"garbage")
    comm.barrier()
    with pytest.raises(ckpt.CheckpointError, match=f"^{bad}: not a valid hpctrain checkpoint: "):
        Trainer(config("badresume2"), resume=str(bad)).fit()


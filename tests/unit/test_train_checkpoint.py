"""Checkpoints: atomic writes (kill -9 trials), keep-K, newest valid, safe loading, RNG
round trip, pre-flight checks of the directory."""
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.train import checkpoint as ckpt


def small_state(step: int, nbytes: int = 1 << 16, run_id: str = "run-a"):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return ckpt.build_state(step=step, epoch=step // 10, step_in_epoch=step % 10, model=model, optimizer=opt,
                            scheduler={"kind": "constant", "step": step}, rng=[ckpt.capture_rng()],
                            config={"seed": 1}, run_id=run_id,
                            extra={"payload": torch.full((nbytes // 4,), float(step))})


def test_save_load_roundtrip_weights_only(tmp_path):
    state = small_state(7)
    saved = ckpt.save(tmp_path, state, keep=3)
    assert saved.path.name == "ckpt-000000007.pt" and saved.nbytes > 0
    back = ckpt.load_checkpoint(saved.path)
    assert back["step"] == 7 and back["epoch"] == 0 and back["step_in_epoch"] == 7
    assert back["hpctrain_version"] and isinstance(back["torch_version"], str)
    for k, v in state["model"].items():
        assert torch.equal(v, back["model"][k])
    assert back["optimizer"]["state"][0]["momentum_buffer"].shape == (3, 4)


def test_rng_roundtrip_restores_all_three_generators():
    import random as pyrandom

    torch.manual_seed(5)
    np.random.seed(5)
    pyrandom.seed(5)
    np.random.standard_normal()  # a cached gaussian state
    st = ckpt.capture_rng()
    a = (torch.rand(3), np.random.rand(3), pyrandom.random(), np.random.standard_normal())
    torch.manual_seed(99)
    np.random.seed(99)
    pyrandom.seed(99)
    ckpt.restore_rng(st)
    b = (torch.rand(3), np.random.rand(3), pyrandom.random(), np.random.standard_normal())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]


def test_keep_last_k_and_newest_first(tmp_path):
    for step in (1, 3, 5, 9, 12):
        ckpt.save(tmp_path, small_state(step), keep=3)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [12, 9, 5]


def test_newest_valid_skips_truncated_and_garbage(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, small_state(step), keep=5)
    newest = tmp_path / ckpt.checkpoint_name(3)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated (a non-atomic copy, a full disk)
    (tmp_path / ckpt.checkpoint_name(4)).write_bytes(b"not a checkpoint")
    path, state = ckpt.newest_valid(tmp_path)
    assert path.name == ckpt.checkpoint_name(2) and state["step"] == 2
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded"):
        ckpt.load_checkpoint(newest)
    assert ckpt.newest_valid(tmp_path / "nothing") is None


class Payload:
    """Unpickling this runs ``touch marker``: the proof that a loader unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_load_rejects_pickled_objects(tmp_path):
    marker = tmp_path / "payload-ran"
    p = tmp_path / "ckpt-000000001.pt"
    torch.save({**small_state(1), "model": Payload(marker)}, p)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(p)
    first = str(info.value).splitlines()[0]
    assert first == f"{p}: not a valid hpctrain checkpoint: it holds a pickled Python object (posix.system), " \
                    "not only tensors and plain types, and hpctrain never unpickles those", first
    assert ckpt.newest_valid(tmp_path) is None
    assert ckpt.classify(p, "run-a").kind == ckpt.BROKEN
    assert not marker.exists()


def test_load_rejects_foreign_dicts(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"weights": torch.ones(2)}, p)
    with pytest.raises(ckpt.CheckpointError, match="not an hpctrain checkpoint"):
        ckpt.load_checkpoint(p)
    torch.save({**small_state(1), "format": 99}, p)
    with pytest.raises(ckpt.CheckpointError, match="format 99"):
        ckpt.load_checkpoint(p)


def _writer(directory: str, seed: int) -> None:
    """Child process: write checkpoints as fast as possible until killed."""
    rng = random.Random(seed)
    step = 0
    while True:
        step += 1
        ckpt.save(Path(directory), small_state(step, nbytes=rng.choice([1 << 14, 1 << 20, 4 << 20])), keep=2)


def test_kill_minus_9_during_writes_never_leaves_a_broken_checkpoint(tmp_path):
    """Many trials: a process writing checkpoints in a loop is SIGKILLed at a random moment;
    every checkpoint file left must load, and the newest valid one must exist."""
    # Writers fork from a clean server process with torch (and the torch._dynamo that an
    # optimizer step imports, 2 s) preloaded: fast to start, and without
    # the test process's threads (torch's pools, perhaps MPI's), which can deadlock a plain fork.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "hpctrain.train.checkpoint", __name__])
    rng = random.Random(1234)
    trials, tmp_seen = 25, 0
    for trial in range(trials):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        p = ctx.Process(target=_writer, args=(str(d), trial), daemon=True)
        p.start()
        deadline = time.monotonic() + 120
        while not ckpt.list_checkpoints(d):  # wait for the first complete checkpoint
            if not p.is_alive():
                pytest.fail(f"writer exited with {p.exitcode} before its first checkpoint")
            if time.monotonic() > deadline:
                p.kill()
                pytest.fail("writer made no checkpoint in 120 s")
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        tmp_seen += sum(1 for n in os.listdir(d) if ".tmp-" in n)
        for _step, path in ckpt.list_checkpoints(d):
            ckpt.load_checkpoint(path)  # raises if any visible checkpoint is broken
        found = ckpt.newest_valid(d)
        assert found is not None
        assert len(ckpt.list_checkpoints(d)) <= 3  # keep=2 (+1 if killed between replace and prune)
        # The next run's first save cleans the dead writer's temporary file.
        ckpt.save(d, small_state(10_000), keep=2)
        assert not [n for n in os.listdir(d) if ".tmp-" in n]
    # Some kills must have hit a write in progress, or the test proves little.
    assert tmp_seen >= 1, "no kill landed inside a write; raise the payload size"


def test_preflight_creates_and_checks_directory(tmp_path):
    ckpt.preflight(tmp_path / "a" / "b", estimate=1000, keep=2)
    assert (tmp_path / "a" / "b").is_dir()
    assert not list((tmp_path / "a" / "b").iterdir())  # the probe file is gone


def test_preflight_unwritable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="cannot be created"):
        ckpt.preflight(blocker / "ckpt", 1000, 2)


def test_preflight_read_only_directory(tmp_path, monkeypatch):
    real_open = open

    def deny(path, *a, **k):
        if ".write-probe-" in str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(ckpt.CheckpointError, match="not writable.*Permission denied"):
        ckpt.preflight(tmp_path, 1000, 2)


def test_preflight_full_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, (10 << 30) - (3 << 20), 3 << 20))
    with pytest.raises(ckpt.CheckpointError, match="too full.*3.0 MiB free"):
        ckpt.preflight(tmp_path, estimate=2 << 20, keep=3)


def test_space_problem_pure():
    assert ckpt.space_problem(100 << 20, 10 << 20, 3) is None
    assert "needs about 10.0 MiB" in ckpt.space_problem(15 << 20, 10 << 20, 3)


def test_estimate_grows_with_model_and_slots():
    m = torch.nn.Linear(1000, 1000)
    a = ckpt.estimate_bytes(m, 0, 1)
    b = ckpt.estimate_bytes(m, 2, 4)
    assert a > 4_000_000 and b > 3 * 4_000_000


# ---------------------------------------------------------------------------- keep-last-K
def _entries(**kinds):
    """Entries from ``ours=[steps], other=[...], broken=[...]``."""
    return [ckpt.Entry(s, Path(ckpt.checkpoint_name(s)), getattr(ckpt, kind.upper()))
            for kind, steps in kinds.items() for s in steps]


@pytest.mark.parametrize("entries, keep, written, delete, quarantine, supersede", [
    # keep counts the one just written; of this run's older ones the newest keep-1 stay
    (_entries(ours=[1, 2, 3, 4, 5]), 3, 6, [3, 2, 1], [], []),
    (_entries(ours=[2, 4]), 1, 6, [4, 2], [], []),
    # a file that does not load is never counted, never deleted: moved aside
    (_entries(ours=[2, 4], broken=[9999]), 1, 6, [4, 2], [9999], []),
    (_entries(ours=[2, 4], broken=[9999]), 5, 6, [], [9999], []),
    # resumed from step 10 into a directory holding 20 and 30 of the same run: the new save
    # of step 15 stays, the abandoned 20 and 30 are moved aside, not deleted
    (_entries(ours=[10, 20, 30]), 1, 15, [10], [], [30, 20]),
    (_entries(ours=[10, 20, 30]), 3, 15, [], [], [30, 20]),
    # other runs' checkpoints and foreign files are left alone, whatever their step
    (_entries(ours=[1, 2], other=[0, 3, 100]), 1, 4, [2, 1], [], []),
    (_entries(other=[3, 100]), 1, 4, [], [], []),
    ([], 1, 1, [], [], []),
])
def test_plan_prune(entries, keep, written, delete, quarantine, supersede):
    plan = ckpt.plan_prune(entries, keep, written)
    steps = lambda paths: [int(ckpt.PATTERN.match(p.name).group(1)) for p in paths]  # noqa: E731
    assert (steps(plan.delete), steps(plan.quarantine), steps(plan.supersede)) == (delete, quarantine, supersede)
    with pytest.raises(ValueError, match="keep=0"):
        ckpt.plan_prune(entries, 0, written)


def _names(directory: Path):
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def test_keep_1_with_a_truncated_newer_file_keeps_the_new_save_and_moves_the_file_aside(tmp_path, caplog):
    """A truncated ckpt-000009999.pt (a copy that ran out of space) outranks every real step by
    name: it must not count towards keep, nor be deleted, nor make the new save vanish."""
    for step in (2, 4):
        ckpt.save(tmp_path, small_state(step), keep=5)
    bad = tmp_path / ckpt.checkpoint_name(9999)
    whole = (tmp_path / ckpt.checkpoint_name(4)).read_bytes()
    data = whole[: len(whole) // 2]
    bad.write_bytes(data)
    path, state = ckpt.newest_valid(tmp_path)  # what --resume auto picks
    assert state["step"] == 4
    saved = ckpt.save(tmp_path, small_state(6, run_id=ckpt.run_id_of(state)), keep=1)
    assert saved.step == 6 and ckpt.load_checkpoint(saved.path)["step"] == 6
    assert _names(tmp_path) == [ckpt.checkpoint_name(6)]
    assert (tmp_path / "quarantine" / bad.name).read_bytes() == data
    assert any(str(bad) in m and "quarantine" in m and "truncated or corrupt" in m for m in caplog.messages), \
        caplog.messages
    assert ckpt.newest_valid(tmp_path)[1]["step"] == 6


def test_resume_from_an_older_step_keeps_the_new_save_and_moves_the_newer_ones_aside(tmp_path, caplog):
    for step in (10, 20, 30):
        ckpt.save(tmp_path, small_state(step), keep=3)
    state = ckpt.load_checkpoint(tmp_path / ckpt.checkpoint_name(10))  # --resume ckpt-000000010.pt
    saved = ckpt.save(tmp_path, small_state(15, run_id=ckpt.run_id_of(state)), keep=1)
    assert saved.path.exists() and saved.step == 15
    assert _names(tmp_path) == [ckpt.checkpoint_name(15)]
    assert _names(tmp_path / "superseded") == [ckpt.checkpoint_name(20), ckpt.checkpoint_name(30)]
    assert ckpt.newest_valid(tmp_path)[1]["step"] == 15  # --resume auto continues the resumed run
    assert any("superseded" in m and ckpt.checkpoint_name(30) in m for m in caplog.messages), caplog.messages


def test_prune_never_touches_other_runs_or_foreign_files(tmp_path):
    ckpt.save(tmp_path, small_state(3, run_id="run-b"), keep=1)
    legacy = small_state(5)
    del legacy["run_id"]  # written before run ids existed
    torch.save(legacy, tmp_path / ckpt.checkpoint_name(5))
    torch.save({"weights": torch.ones(2)}, tmp_path / ckpt.checkpoint_name(100))  # a user's file
    before = {n: (tmp_path / n).read_bytes() for n in _names(tmp_path)}
    for step in (1, 2, 4, 6):
        ckpt.save(tmp_path, small_state(step, run_id="run-a"), keep=1)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert _names(tmp_path) == sorted([*before, ckpt.checkpoint_name(6)])
    kinds = {e.path.name: (e.kind, e.why) for e in map(lambda p: ckpt.classify(tmp_path / p, "run-a"), before)}
    assert kinds[ckpt.checkpoint_name(3)] == (ckpt.OTHER, "a checkpoint of another run (run id run-b)")
    assert kinds[ckpt.checkpoint_name(5)][1] == "a checkpoint without a run id (written by an older hpctrain)"
    assert kinds[ckpt.checkpoint_name(100)][0] == ckpt.OTHER


def test_a_save_under_the_name_of_a_file_it_did_not_write_moves_that_file_aside(tmp_path):
    ckpt.save(tmp_path, small_state(7, run_id="run-b"), keep=1)
    other = (tmp_path / ckpt.checkpoint_name(7)).read_bytes()
    ckpt.save(tmp_path, small_state(7, run_id="run-a"), keep=1)
    assert ckpt.load_checkpoint(tmp_path / ckpt.checkpoint_name(7))["run_id"] == "run-a"
    assert (tmp_path / "superseded" / ckpt.checkpoint_name(7)).read_bytes() == other
    (tmp_path / ckpt.checkpoint_name(8)).write_bytes(b"garbage")
    ckpt.save(tmp_path, small_state(8, run_id="run-a"), keep=1)
    assert (tmp_path / "quarantine" / ckpt.checkpoint_name(8)).read_bytes() == b"garbage"
    # this run's own file at the same step is simply replaced (atomically)
    ckpt.save(tmp_path, small_state(8, run_id="run-a"), keep=1)
    assert _names(tmp_path) == [ckpt.checkpoint_name(8)] and _names(tmp_path / "quarantine") == [
        ckpt.checkpoint_name(8)]


def test_a_payload_under_a_checkpoint_name_never_runs_and_is_moved_aside(tmp_path, caplog):
    marker = tmp_path / "payload-ran"
    ckpt.save(tmp_path, small_state(2), keep=3)
    evil = tmp_path / ckpt.checkpoint_name(50)
    torch.save({**small_state(50), "optimizer": Payload(marker)}, evil)
    assert ckpt.newest_valid(tmp_path)[1]["step"] == 2  # skipped, with a warning naming it
    assert any(str(evil) in m and "not a valid hpctrain checkpoint" in m for m in caplog.messages)
    ckpt.save(tmp_path, small_state(3), keep=3)
    assert (tmp_path / "quarantine" / evil.name).exists() and not evil.exists()
    assert not marker.exists()


def test_run_id_is_carried_through_a_resume_and_new_otherwise():
    assert ckpt.run_id_of({"run_id": "abc"}) == "abc"
    fresh = {ckpt.run_id_of(None), ckpt.run_id_of({}), ckpt.run_id_of({"run_id": ""})}
    assert len(fresh) == 3 and all(len(r) == 32 for r in fresh)


def test_save_needs_a_run_id(tmp_path):
    state = small_state(1)
    del state["run_id"]
    with pytest.raises(ValueError, match="run_id"):
        ckpt.save(tmp_path, state, keep=1)
    assert not _names(tmp_path)


def test_numpy_values_are_stored_as_plain_types(tmp_path):
    """balance weights computed with numpy (np.float64) would not load with weights_only."""
    state = ckpt.build_state(step=1, epoch=0, step_in_epoch=1, model=torch.nn.Linear(2, 2),
                             optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                             scheduler=None, rng=[ckpt.capture_rng()], config={"lr": np.float64(0.1)},
                             run_id="run-a", extra={"balance_weights": list(np.array([0.25, 0.75])),
                                                    "counts": np.arange(3)})
    back = ckpt.load_checkpoint(ckpt.save(tmp_path, state, keep=1).path)
    assert back["extra"]["balance_weights"] == [0.25, 0.75] and type(back["config"]["lr"]) is float
    assert torch.equal(back["extra"]["counts"], torch.arange(3))

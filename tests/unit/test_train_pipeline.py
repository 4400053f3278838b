"""The runner's pipeline pieces that need no MPI: checkpoint directories (listing, checks,
pruning, refusing planted payloads), the targets+mask object the pipeline slices, which keys
each stage reads."""
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from hpctrain.parallel import checkpoint as stage_ckpt
from hpctrain.train import checkpoint as ckpt
from hpctrain.train import pipeline as pp

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this runs ``touch marker``: the proof that a loader unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _stage_file(s: int, stages: int) -> dict:
    return {"format": stage_ckpt.FORMAT, "stage": s, "stages": stages, "layers": [str(s)],
            "split_points": [1], "num_layers": stages,
            "state_dict": OrderedDict([(f"{s}.weight", torch.full((2, 2), float(s)))]), "optimizer": None,
            "extra": {}}


def _write(directory: Path, step: int, stages: int = 2, skip_stage=None, meta=True, run_id="run-a") -> Path:
    d = directory / pp.checkpoint_name(step)
    d.mkdir(parents=True)
    for s in range(stages):
        if s != skip_stage:
            torch.save(_stage_file(s, stages), d / f"stage-{s:03d}-of-{stages:03d}.pt")
    if meta:
        torch.save({"format": pp.META_FORMAT, "step": step, "stages": stages, "run_id": run_id}, d / pp.META_NAME)
    return d


def test_list_newest_first_and_ignore_other_entries(tmp_path):
    for step in (3, 12, 6):
        _write(tmp_path, step)
    (tmp_path / ".pipeline-000000015.tmp").mkdir()
    (tmp_path / "pipeline-000000020").write_text("a file, not a checkpoint directory")
    (tmp_path / "ckpt-000000009.pt").write_text("x")
    assert [s for s, _ in pp.list_checkpoints(tmp_path)] == [12, 6, 3]
    assert pp.list_checkpoints(tmp_path / "missing") == []


def test_newest_valid_skips_incomplete_checkpoints(tmp_path):
    _write(tmp_path, 4)
    _write(tmp_path, 8, skip_stage=1)      # a stage file missing
    _write(tmp_path, 9, meta=False)        # meta.pt missing
    path, meta = pp.newest_valid(tmp_path)
    assert path.name == pp.checkpoint_name(4) and meta["step"] == 4
    with pytest.raises(ckpt.CheckpointError, match=r"stage\(s\) \[1\] are missing"):
        pp.load_meta(tmp_path / pp.checkpoint_name(8))
    with pytest.raises(ckpt.CheckpointError, match="has no meta.pt"):
        pp.load_meta(tmp_path / pp.checkpoint_name(9))
    with pytest.raises(ckpt.CheckpointError, match="not a pipeline checkpoint directory"):
        pp.load_meta(tmp_path / "nowhere")
    torch.save({"format": "something else"}, tmp_path / pp.checkpoint_name(4) / pp.META_NAME)
    with pytest.raises(ckpt.CheckpointError, match="not an hpctrain pipeline checkpoint"):
        pp.load_meta(tmp_path / pp.checkpoint_name(4))


def test_prune_keeps_newest_and_removes_stale_temporaries(tmp_path):
    for step in (1, 2, 3):
        _write(tmp_path, step)
    (tmp_path / ".pipeline-000000007.tmp").mkdir()
    pp.prune(tmp_path, keep=2, run_id="run-a", written=tmp_path / pp.checkpoint_name(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [pp.checkpoint_name(2), pp.checkpoint_name(3)]


def test_prune_counts_only_this_runs_loadable_checkpoints(tmp_path):
    """keep=1 with a broken pipeline-000009999/ (and another run's checkpoint) in the
    directory: the one just written stays, the broken one is moved aside, the other run's stays."""
    for step in (2, 4, 6):
        _write(tmp_path, step)
    _write(tmp_path, 9999, skip_stage=1)
    _write(tmp_path, 500, run_id="run-b")
    pp.prune(tmp_path, keep=1, run_id="run-a", written=tmp_path / pp.checkpoint_name(6))
    assert [s for s, _ in pp.list_checkpoints(tmp_path)] == [500, 6]
    assert (tmp_path / "quarantine" / pp.checkpoint_name(9999) / pp.META_NAME).exists()
    # resumed from step 6 into a directory holding 8 and 10 of the same run: 7 is written
    for step in (8, 10):
        _write(tmp_path, step)
    _write(tmp_path, 7)
    pp.prune(tmp_path, keep=1, run_id="run-a", written=tmp_path / pp.checkpoint_name(7))
    assert [s for s, _ in pp.list_checkpoints(tmp_path)] == [500, 7]
    assert sorted(p.name for p in (tmp_path / "superseded").iterdir()) == [pp.checkpoint_name(8),
                                                                           pp.checkpoint_name(10)]
    assert pp.newest_valid(tmp_path)[0].name == pp.checkpoint_name(500)  # another run: left where it was


def test_payload_in_a_stage_file_or_meta_never_runs(tmp_path, caplog):
    """Every reader of pipeline checkpoint files: load_meta / newest_valid (--resume), the
    stage loader, pruning, and the merge tool (in process and from the shell)."""
    marker = tmp_path / "payload-ran"
    _write(tmp_path, 2)
    d4 = _write(tmp_path, 4)
    stage1 = d4 / "stage-001-of-002.pt"
    torch.save({**_stage_file(1, 2), "optimizer": Payload(marker)}, stage1)
    d6 = _write(tmp_path, 6)
    torch.save({"format": pp.META_FORMAT, "step": 6, "stages": 2, "rng": Payload(marker)}, d6 / pp.META_NAME)
    for d, bad in ((d4, stage1), (d6, d6 / pp.META_NAME)):
        with pytest.raises(ckpt.CheckpointError) as info:
            pp.load_meta(d)
        assert str(info.value) == (f"{bad}: not a valid hpctrain checkpoint: it holds a pickled Python object "
                                   "(posix.system), not only tensors and plain types, and hpctrain never "
                                   "unpickles those")
    assert pp.newest_valid(tmp_path)[0] == tmp_path / pp.checkpoint_name(2)
    assert sum("not a valid hpctrain checkpoint" in m for m in caplog.messages) == 2
    with pytest.raises(stage_ckpt.CheckpointError, match="not a valid hpctrain checkpoint"):
        stage_ckpt.read_stage_file(str(stage1))
    with pytest.raises(stage_ckpt.CheckpointError, match="not a valid hpctrain checkpoint"):
        stage_ckpt.merge_stage_checkpoints(str(d4))
    out = tmp_path / "merged.pt"
    for argv in (["merge", str(d4), "-o", str(out)], ["merge", str(d4 / "stage-000-of-002.pt"), str(stage1),
                                                      "-o", str(out)]):
        assert stage_ckpt.main(argv) == 2
    shell = subprocess.run([sys.executable, "-m", "hpctrain.parallel.checkpoint", "merge", str(d4), "-o", str(out)],
                           capture_output=True, text=True, cwd=str(ROOT), timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shell.returncode == 2, shell.stderr
    # (the last line: runpy may warn first that the package imported the module)
    assert shell.stderr.strip().splitlines()[-1] == f"error: {stage1}: not a valid hpctrain checkpoint: it holds a pickled Python " \
                                   "object (posix.system), not only tensors and plain types, and hpctrain never " \
                                   "unpickles those", shell.stderr
    assert not out.exists() and "Traceback" not in shell.stderr
    pp.prune(tmp_path, keep=3, run_id="run-a", written=tmp_path / pp.checkpoint_name(2))
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == [pp.checkpoint_name(4),
                                                                           pp.checkpoint_name(6)]
    assert not marker.exists()


def test_merge_of_good_stage_files_loads_with_weights_only(tmp_path):
    d = _write(tmp_path, 2)
    out = tmp_path / "merged.pt"
    assert stage_ckpt.main(["merge", str(d), "-o", str(out)]) == 0
    merged = torch.load(out, weights_only=True)
    assert list(merged) == ["0.weight", "1.weight"]


def test_targets_slice_and_move_together():
    t = pp.Targets(torch.arange(6), torch.tensor([True] * 5 + [False]))
    part = t[2:6]
    assert len(t) == 6 and len(part) == 4
    assert part.y.tolist() == [2, 3, 4, 5] and part.mask.tolist() == [True, True, True, False]
    moved = part.to("cpu")
    assert torch.equal(moved.y, part.y) and torch.equal(moved.mask, part.mask)


def test_stage_0_reads_x_the_others_y():
    assert pp.loader_keys(0, 3, "img", "label") == ["img"]
    assert pp.loader_keys(1, 3, "img", "label") == ["label"]
    assert pp.loader_keys(2, 3, "img", "label") == ["label"]

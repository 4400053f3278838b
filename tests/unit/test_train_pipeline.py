"""The runner's pipeline pieces that need no MPI: checkpoint directories (listing, checks,
pruning), the targets+mask object the pipeline slices, which keys each stage reads."""
from pathlib import Path

import pytest
import torch

from hpctrain.train import checkpoint as ckpt
from hpctrain.train import pipeline as pp


def _write(directory: Path, step: int, stages: int = 2, skip_stage=None, meta=True) -> Path:
    d = directory / pp.checkpoint_name(step)
    d.mkdir(parents=True)
    for s in range(stages):
        if s != skip_stage:
            torch.save({"stage": s}, d / f"stage-{s:03d}-of-{stages:03d}.pt")
    if meta:
        torch.save({"format": pp.META_FORMAT, "step": step, "stages": stages}, d / pp.META_NAME)
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
    pp.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [pp.checkpoint_name(2), pp.checkpoint_name(3)]


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

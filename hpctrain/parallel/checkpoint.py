"""Per-stage checkpoints of a pipeline, and the tool that merges them into one ordinary
``state_dict`` of the original ``nn.Sequential``.

Each stage writes ``stage-<s>-of-<S>.pt`` (only replica 0 of a DP × PP job; the replicas hold
equal weights). The file holds the stage's tensors under the original model's keys (a stage
is an ``nn.Sequential`` whose children keep their original names, e.g. ``'3.weight'``) and
metadata: stage index, stage count, layer names, split points. Merging checks that every stage
is there exactly once, that they come from the same split, and that no key repeats.

A stage file holds tensors and plain Python types only and is read with
``torch.load(weights_only=True)`` (:mod:`hpctrain.serialization`): a file that needs more is
refused as not a valid hpctrain checkpoint, and nothing in it runs.

    python -m hpctrain.parallel.checkpoint merge CKPT_DIR -o model.pt
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from hpctrain.serialization import NotPlainFile, load_plain, to_plain

FORMAT = "hpctrain.pipeline-stage/1"
_NAME = re.compile(r"stage-(\d+)-of-(\d+)\.pt$")


class CheckpointError(ValueError):
    """Stage checkpoints that do not form one model."""


def stage_checkpoint_path(directory: str, stage: int, stages: int) -> str:
    return os.path.join(directory, f"stage-{stage:03d}-of-{stages:03d}.pt")


def stage_state(pipe: Any, optimizer: Any = None, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The dict a stage checkpoint holds: tensors and plain Python types only, so that it
    loads with ``weights_only=True`` (TypeError naming the key otherwise)."""
    return to_plain({
        "format": FORMAT,
        "stage": int(pipe.stage),
        "stages": int(pipe.stages),
        "layers": [str(name) for name in pipe.layer_names],
        "split_points": [int(p) for p in pipe.plan.split_points],
        "num_layers": int(pipe.plan.num_layers),
        "state_dict": OrderedDict((k, v.detach().cpu()) for k, v in pipe.state_dict().items()),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "extra": extra or {},
    }, where="stage checkpoint")


def save_stage_checkpoint(pipe: Any, directory: str, optimizer: Any = None,
                          extra: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Write this stage's checkpoint (replica 0 only; other replicas return None). Atomic:
    written to a temporary name and fsync-ed, then renamed. No communication."""
    if getattr(pipe, "replica", 0) != 0:
        return None
    os.makedirs(directory, exist_ok=True)
    path = stage_checkpoint_path(directory, pipe.stage, pipe.stages)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(stage_state(pipe, optimizer, extra), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_stage_checkpoint(pipe: Any, directory: str, optimizer: Any = None) -> Dict[str, Any]:
    """Load this stage's weights (and optimizer state) from ``directory``; returns ``extra``."""
    path = stage_checkpoint_path(directory, pipe.stage, pipe.stages)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint for stage {pipe.stage} of {pipe.stages}: {path} does not exist.\n"
                              f"HINT: the directory holds {sorted(os.listdir(directory)) if os.path.isdir(directory) else 'nothing'}")
    state = read_stage_file(path)
    if state["stages"] != pipe.stages or list(state["layers"]) != list(pipe.layer_names):
        raise CheckpointError(
            f"{path} is stage {state['stage']} of {state['stages']} with layers {state['layers']}, but this rank is "
            f"stage {pipe.stage} of {pipe.stages} with layers {pipe.layer_names}.\nHINT: resume with the same "
            "stages and split, or merge the checkpoint (python -m hpctrain.parallel.checkpoint merge) and re-split")
    pipe.load_state_dict(state["state_dict"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state.get("extra") or {}


def read_stage_file(path: str, *, mmap: bool = False) -> Dict[str, Any]:
    """One stage file's dict, loaded with ``weights_only=True`` (``mmap``: tensors mapped, not
    read). CheckpointError with one line naming the file when it is not a stage checkpoint."""
    try:
        state = load_plain(path, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such stage checkpoint file") from None
    except NotPlainFile as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a valid hpctrain checkpoint: not a pipeline stage file (format {FORMAT!r})")
    return state



def merge_stage_checkpoints(source: Union[str, Sequence[Union[str, Dict[str, Any]]]]) -> "OrderedDict[str, torch.Tensor]":
    """One ``state_dict`` of the original model from a directory of stage files, a list of
    paths, or a list of :func:`stage_state` dicts. Keys come in stage order."""
    if isinstance(source, str):
        if not os.path.isdir(source):
            raise CheckpointError(f"{source} is not a directory of stage checkpoints")
        paths = sorted(p for p in glob.glob(os.path.join(source, "stage-*-of-*.pt")) if _NAME.search(p))
        if not paths:
            raise CheckpointError(f"{source} holds no stage-*-of-*.pt files")
        source = paths
    states: List[Dict[str, Any]] = []
    for item in source:
        states.append(read_stage_file(item) if isinstance(item, str) else item)
    if not states:
        raise CheckpointError("no stage checkpoints to merge")
    totals = {s["stages"] for s in states}
    if len(totals) != 1:
        raise CheckpointError(f"stage checkpoints come from pipelines of different sizes: {sorted(totals)}")
    total = totals.pop()
    splits = {tuple(s.get("split_points", ())) for s in states}
    if len(splits) != 1:
        raise CheckpointError(f"stage checkpoints come from different splits: {sorted(splits)}")
    by_stage: Dict[int, Dict[str, Any]] = {}
    for s in states:
        if s["stage"] in by_stage:
            raise CheckpointError(f"stage {s['stage']} appears twice")
        by_stage[s["stage"]] = s
    missing = sorted(set(range(total)) - set(by_stage))
    if missing:
        raise CheckpointError(f"stages {missing} of {total} are missing; got {sorted(by_stage)}")
    merged: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for stage in range(total):
        for key, value in by_stage[stage]["state_dict"].items():
            if key in merged:
                raise CheckpointError(f"key {key!r} appears in more than one stage (stage {stage} and an earlier one)")
            merged[key] = value
    return merged


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpctrain.parallel.checkpoint",
                                description="Merge pipeline stage checkpoints into one state_dict.",
                                epilog="example: python -m hpctrain.parallel.checkpoint merge ckpt/step-100 -o model.pt")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge stage-*-of-*.pt into one state_dict file")
    m.add_argument("inputs", nargs="+", help="a directory of stage files, or the files themselves")
    m.add_argument("-o", "--output", required=True, help="where to write the merged state_dict (torch.save)")
    args = p.parse_args(argv)
    try:
        src = args.inputs[0] if len(args.inputs) == 1 and os.path.isdir(args.inputs[0]) else list(args.inputs)
        merged = merge_stage_checkpoints(src)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        torch.save(merged, args.output)
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(merged)} tensors to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

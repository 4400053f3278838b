"""Pipeline-parallel benchmark: throughput against the micro-batch count M, and the measured
bubble against the theoretical (S−1)/(M+S−1), for GPipe and 1F1B.

The model is an MLP of --layers blocks (Linear + ReLU, --width wide), split into S stages by
parameter count; with more ranks than stages the rest is data parallel (world = DP × S). For
each schedule and M: --warmup untimed steps, then --steps timed ones. A step's time is the
slowest rank's; throughput = DP × --batch rows / step time. The measured bubble is the mean over
stages of 1 − compute / wall (time spent waiting for neighbours, sending and receiving counts
as bubble). Peak activation memory is the largest stage's bytes held for backward.

  hpctrain launch -n 2 -- hpctrain bench pipeline --micro-batches 1,2,4,8,16
  hpctrain launch -n 4 -- hpctrain bench pipeline --stages 2 --schedules 1f1b --json pp.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch

from hpctrain import comm
from hpctrain.parallel import PipelineModule, bubble_fraction, distributed_optimizer
from hpctrain.parallel.schedule import SCHEDULES, normalize_schedule


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=None, help="pipeline stages S (default: all ranks, DP = 1)")
    p.add_argument("--micro-batches", default="1,2,4,8,16", help="comma list of micro-batch counts M")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma list of: " + ", ".join(SCHEDULES))
    p.add_argument("--batch", type=int, default=64, help="rows per pipeline replica per step")
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks (≥ stages)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")


def build_model(layers: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: List[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*mods)


def _parse_list(text: str, what: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"bench pipeline: --{what} must be a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"bench pipeline: --{what} needs positive integers, got {text!r}")
    return values


def measure(args: argparse.Namespace, schedule: str, stages: int, m: int) -> Dict[str, float]:
    """One (schedule, M) point; every rank returns the same record."""
    pipe = PipelineModule(build_model(args.layers, args.width), stages=stages, micro_batches=m, schedule=schedule)
    opt = distributed_optimizer(pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = torch.nn.functional.cross_entropy
    bubbles, steps, mem = [], [], 0
    for i in range(args.warmup + args.steps):
        opt.zero_grad()
        comm.barrier(pipe.pipeline_group)
        t0 = time.perf_counter()
        pipe.train_step(x, y, loss_fn)
        opt.step()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            steps.append(dt)
            bubbles.append(pipe.last_stats.bubble_fraction)
            mem = max(mem, pipe.last_stats.peak_activation_bytes)
    local = torch.tensor([statistics.mean(steps), statistics.mean(bubbles), float(mem)], dtype=torch.float64)
    step_max = float(comm.allreduce(local[:1].clone(), op="max")[0])
    bubble_mean = float(comm.allreduce(local[1:2].clone(), op="avg")[0])
    mem_max = float(comm.allreduce(local[2:3].clone(), op="max")[0])
    dp = comm.size() // stages
    return {
        "schedule": schedule, "stages": stages, "data_parallel": dp, "micro_batches": m,
        "batch_per_replica": args.batch, "step_s": step_max, "samples_per_s": dp * args.batch / step_max,
        "bubble_measured": bubble_mean, "bubble_theory": bubble_fraction(stages, m),
        "peak_activation_mib": mem_max / 2**20,
    }


def run(args: argparse.Namespace) -> int:
    comm.init()
    torch.set_num_threads(max(1, args.threads))
    stages = args.stages or comm.size()
    ms = _parse_list(args.micro_batches, "micro-batches")
    try:
        schedules = [normalize_schedule(s) for s in args.schedules.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"bench pipeline: {exc}") from None
    too_big = [m for m in ms if m > args.batch]
    if too_big:
        raise SystemExit(f"bench pipeline: micro-batch counts {too_big} exceed --batch {args.batch} rows")
    if args.layers * 2 + 1 < stages:
        raise SystemExit(f"bench pipeline: {args.layers} blocks cannot fill {stages} stages; raise --layers")
    records = []
    if comm.rank() == 0:
        print(f"# bench pipeline: {comm.size()} ranks = {comm.size() // max(stages, 1)} DP × {stages} stages, "
              f"MLP {args.layers}×{args.width}, {args.batch} rows/replica, {args.steps} timed steps")
        print(f"{'schedule':>8} {'M':>4} {'step ms':>9} {'samples/s':>10} {'bubble':>7} {'theory':>7} {'act MiB':>8}")
    for schedule in schedules:
        for m in ms:
            rec = measure(args, schedule, stages, m)
            records.append(rec)
            if comm.rank() == 0:
                print(f"{schedule:>8} {m:>4} {rec['step_s'] * 1e3:>9.2f} {rec['samples_per_s']:>10.1f} "
                      f"{rec['bubble_measured']:>7.3f} {rec['bubble_theory']:>7.3f} {rec['peak_activation_mib']:>8.2f}",
                      flush=True)
    if args.json and comm.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0

"""Calibrate the scaling model on the machines at hand: one rank's compute per step (forward,
backward and when backward produces each gradient), the gradients and their bucket plan, one
node's all-reduce cost, the reduction throughput and, with two nodes or more, the network's
latency and bandwidth by ping-pong; then a few real data-parallel steps to compare with.
Rank 0 writes the profile that ``hpctrain plan`` reads (docs/scaling.md).

  mpiexec -n 4 hpctrain bench calibrate config.yaml --out profile.json
  hpctrain plan --profile profile.json --nodes 1,2,4,8,16 --ranks-per-node 4 --fabric ib-hdr

The model, optimizer, loss and batch size are the config's; the batch is synthetic (the
shape of the config's training data), so the loader is not measured. Times are medians over
``--steps`` after ``--warmup``, taken on every rank at once (ranks share the node as they will
in training); the profile keeps the slowest rank's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from hpctrain import comm
from hpctrain.bench.allreduce import iterations, timed
from hpctrain.scaling.fabrics import Link, link_from_spec
from hpctrain.scaling.profile import Param, Profile

SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
PING_SIZES = (8, 1024 * 1024, 8 * 1024 * 1024)
REPEATS = 3  # timings per size of the intra-node link; the best is fitted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.yaml", help="a training config (`hpctrain train` reads the same)")
    p.add_argument("--out", default="profile.json", help="where rank 0 writes the profile (default profile.json)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the config's batch_size)")
    p.add_argument("--fabric", default=None,
                   help="inter-node link to store when calibrating on one node: a name (roce25, ib-hdr, …) or "
                        "'LATENCY,BANDWIDTH'")


# ----------------------------------------------------------------------------- compute
def build(args: argparse.Namespace) -> Tuple[Any, Any, Any, Any, Any]:
    """(config, model, optimizer, loss_fn, make_batch) as `hpctrain train` would build them."""
    from hpctrain.data import roles
    from hpctrain.data.h5files import describe, expand_paths
    from hpctrain.train.build import (auto_threads, import_factory, infer_model_kwargs, make_optimizer, per_sample_loss,
                                      resolve_device)
    from hpctrain.train.config import load_config
    from hpctrain.train.losses import parse_loss

    cfg = load_config(args.config)
    if not cfg.data.keys:  # as `hpctrain train` does: the roles `hpctrain data pack` recorded
        cfg.data.resolve_keys(roles(expand_paths(list(cfg.data.train))[0]))
    auto_threads(cfg)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = import_factory(cfg.model.factory)(**infer_model_kwargs(cfg)).to(device)
    batch = args.batch or (cfg.batch_size if cfg.batch_size != "auto" else 32)
    xk, yk = cfg.data.x_key, cfg.data.keys["y"]
    info = describe(expand_paths(list(cfg.data.train))[0], [xk, yk])
    xshape, yshape = info.keys[xk].shape[1:], info.keys[yk].shape[1:]
    classify = parse_loss(cfg.loss).classification is not False
    x = torch.rand((int(batch), *xshape), device=device)
    y = (torch.zeros((int(batch),), dtype=torch.long) if classify else torch.zeros((int(batch), *yshape))).to(device)
    opt = make_optimizer(cfg, model.parameters(), cfg.optimizer.lr)
    return cfg, model, opt, (lambda out: per_sample_loss(cfg, out, y).mean()), (int(batch), x)


def _now(x: torch.Tensor) -> float:
    """The time once the device has finished what was queued (GPU kernels run asynchronously)."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def time_compute(model, opt, loss_fn, x, steps: int, warmup: int) -> Dict[str, Any]:
    """Median forward, backward and optimizer seconds of plain (undistributed) steps, and
    each parameter's median ready time after backward began (post-accumulate-grad hooks; on
    a GPU they fire when autograd queues the gradient's last kernel, so the times lead the
    device by what is in its queue)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ready: List[List[float]] = [[] for _ in params]
    stamps: Dict[int, float] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
             for i, p in enumerate(params)]
    fwd, bwd, upd = [], [], []
    try:
        for step in range(warmup + steps):
            opt.zero_grad()
            stamps.clear()
            t0 = _now(x)
            loss = loss_fn(model(x))
            t1 = _now(x)
            loss.backward()
            t2 = _now(x)
            opt.step()
            t3 = _now(x)
            if step >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                upd.append(t3 - t2)
                for i in range(len(params)):
                    ready[i].append(stamps.get(i, t2) - t1)
    finally:
        for h in hooks:
            h.remove()
    return {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "optimizer_s": statistics.median(upd), "ready_s": [statistics.median(r) for r in ready]}


def time_distributed(model, opt, loss_fn, x, cfg, steps: int, warmup: int) -> Tuple[float, bool]:
    """Median step of real data-parallel steps (DistributedOptimizer), slowest rank; and
    whether the optimizer overlapped communication with backward (it decides by the cores)."""
    import hpctrain.torch as hvd
    from hpctrain.train.build import sync_name

    dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    fusion_threshold=cfg.sync.fusion_threshold, sync=sync_name(cfg))
    times = []
    comm.barrier()  # once: the steps' own all-reduces keep the ranks together, as in training
    try:
        for step in range(warmup + steps):
            t0 = _now(x)
            dist.zero_grad()
            loss_fn(model(x)).backward()
            dist.step()
            if step >= warmup:
                times.append(_now(x) - t0)
        overlapped = bool(dist._overlap)
    finally:
        dist.remove_hooks()
    return max(comm.allgather_object(statistics.median(times))), overlapped


# ----------------------------------------------------------------------------- links
def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(intercept, slope) of the least-squares line, both clamped at >= 0."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(float(intercept), 0.0), max(float(slope), 1e-15)


def reduction_throughput() -> float:
    """Bytes per second one rank reduces (``a += b``, float32, 8 MiB: past the caches)."""
    a = np.ones(2 * 1024 * 1024, np.float32)
    b = np.ones_like(a)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t0)
    return a.nbytes / statistics.median(times[2:])


def intra_node_link(steps: int, gamma: float) -> Link:
    """One node's shared-memory all-reduce timed at SIZES, fitted to the model's form
    (``model.shm_time``: 2α + 2n/β + (G−1)/G·n/γ). On one node, on the world group, as
    training runs it (a group of its own can lack the world's shared-memory flags); across
    nodes, every node's ranks on a group of their own, all at once."""
    w = comm.world()
    topo = w.topology
    if topo.single_node:
        mine = None
        local = w.size
    else:
        groups = [comm.new_group(topo.ranks_on(n)) for n in range(topo.num_nodes)]
        mine = next(g for g in groups if g is not None)
        local = mine.size
    if local == 1:
        return Link(5e-6, 5e9)
    times = []
    for nbytes in SIZES:
        buf = np.ones(nbytes // 4, np.float32)
        # back-to-back calls, as a step's buckets go: one barrier per timing, not per call,
        # so that ranks leaving a barrier at different moments do not count as latency. The
        # best of REPEATS timings: on a shared node a burst of other work during one timing
        # would otherwise be fitted as the link's latency (7.6x too slow a predicted step seen).
        times.append(min(timed(lambda: comm.allreduce_(buf, algorithm="shm", group=mine),
                               iterations(nbytes, steps), 2) for _ in range(REPEATS)))
    return shm_link_from_times(SIZES, times, local, gamma)


def shm_link_from_times(sizes: Sequence[int], times: Sequence[float], local: int, gamma: float) -> Link:
    """The intra-node link that makes ``model.shm_time`` fit the measured times. A noisy
    machine can give a flat or falling line: then the largest size alone sets the bandwidth
    (its whole time charged to bytes, an upper bound on the cost)."""
    intercept, slope = fit_line(sizes, times)
    copy_slope = slope - (local - 1) / local / gamma
    if slope <= 1e-14 or copy_slope <= 0:
        return Link(intercept / 2, 2 * sizes[-1] / max(times[-1], 1e-9))
    return Link(intercept / 2, 2 / copy_slope)


def inter_node_link(steps: int) -> Link:
    """Ping-pong between world rank 0 and the first rank of node 1 (half round trips), fitted
    to α + n/β; the other ranks wait."""
    from mpi4py import MPI  # noqa: the benchmark measures the raw library's point-to-point

    w = comm.world()
    peer = w.topology.ranks_on(1)[0]
    me = w.rank
    mpi = w.comm
    halves = []
    for nbytes in PING_SIZES:
        buf = np.zeros(max(nbytes, 1), np.uint8)
        samples = []
        for i in range(2 + steps):
            if me == 0:
                t0 = MPI.Wtime()
                mpi.Send(buf, dest=peer, tag=7)
                mpi.Recv(buf, source=peer, tag=7)
                if i >= 2:
                    samples.append((MPI.Wtime() - t0) / 2)
            elif me == peer:
                mpi.Recv(buf, source=0, tag=7)
                mpi.Send(buf, dest=0, tag=7)
        halves.append(statistics.median(samples) if samples else 0.0)
    halves = comm.broadcast_object(halves)
    alpha = halves[0]
    _, slope = fit_line(PING_SIZES[1:], halves[1:])
    return Link(alpha, 1 / slope)


# ----------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    import hpctrain.torch as hvd
    from hpctrain.torch.buckets import fusion_threshold_from_env

    hvd.init()
    cfg, model, opt, loss_fn, (batch, x) = build(args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compute = time_compute(model, opt, loss_fn, x, args.steps, args.warmup)
    everyone = comm.allgather_object(compute)
    slowest = max(everyone, key=lambda c: c["forward_s"] + c["backward_s"] + c["optimizer_s"])
    gamma = min(comm.allgather_object(reduction_throughput()))
    intra = intra_node_link(args.steps, gamma)
    topo = comm.world().topology
    inter = inter_node_link(args.steps) if topo.num_nodes > 1 else (
        link_from_spec(args.fabric) if args.fabric else None)
    step_s, overlapped = time_distributed(model, opt, loss_fn, x, cfg, args.steps, args.warmup)
    if comm.rank() != 0:
        return 0
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    dtypes = [str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad]
    threshold = cfg.sync.fusion_threshold if cfg.sync.fusion_threshold is not None else fusion_threshold_from_env()
    profile = Profile(
        name=str(args.config), batch_per_rank=batch, forward_s=slowest["forward_s"],
        backward_s=slowest["backward_s"], optimizer_s=slowest["optimizer_s"],
        params=tuple(Param(n, s, d, r) for n, s, d, r in zip(names, shapes, dtypes, slowest["ready_s"])),
        intra=intra, inter=inter, gamma_Bps=gamma, fusion_threshold=int(threshold), overlap=overlapped,
        measured={"ranks": topo.size, "nodes": topo.num_nodes, "ranks_per_node": topo.size // topo.num_nodes,
                  "step_s": step_s, "inter_measured": topo.num_nodes > 1})
    import json

    with open(args.out, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
    print(f"hpctrain bench calibrate: {topo.size} rank(s) on {topo.num_nodes} node(s); per rank: forward "
          f"{profile.forward_s * 1e3:.2f} ms, backward {profile.backward_s * 1e3:.2f} ms, optimizer "
          f"{profile.optimizer_s * 1e3:.2f} ms; gradients {profile.gradient_bytes} bytes in {len(names)} tensors; "
          f"intra α {intra.alpha_s * 1e6:.1f} µs β {intra.bandwidth_Bps / 1e9:.2f} GB/s; γ {gamma / 1e9:.2f} GB/s; "
          + (f"inter α {inter.alpha_s * 1e6:.1f} µs β {inter.bandwidth_Bps / 1e9:.2f} GB/s; " if inter else
             "inter: not measured (one node; give --fabric at plan time); ")
          + f"data-parallel step {step_s * 1e3:.2f} ms\nwrote {args.out}", file=sys.stdout)
    return 0

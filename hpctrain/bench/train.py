"""Training-step benchmark: hpctrain's DistributedOptimizer against a plain PyTorch loop,
DDP over Gloo (torch.distributed bootstrapped through MPI) and Horovod (when importable), in
one run, at the launched number of ranks.

Models: an MLP 1024-2048-2048-2048-10 (10.5M parameters, 42 MB of fp32 gradients) and a small
CNN (CIFAR-sized input). Synthetic data generated once (no loader cost), SGD with momentum,
``--threads`` torch threads per rank. Each competitor runs ``--warmup`` steps, then ``--steps``
timed ones; the table shows the median step time (slowest rank), samples/s over all ranks,
and the split of an hpctrain step:

- compute: forward + backward + optimizer update (the hooks start communication inside backward);
- wait: time ``step()`` blocked on communication that backward did not hide;
  (``hpctrain`` uses the default overlap choice; ``hpctrain-overlap`` forces overlap during
  backward, ``hpctrain-sync`` starts every bucket in ``step()``, so its wait ≈ comm)
- comm: the same buckets all-reduced alone (no compute running), median — what communication
  would cost if nothing overlapped it.

For DDP and Horovod only step and samples/s are measured (their communication runs inside
their own machinery); ``plain`` is the same loop without any communication (each rank alone),
so at 1 rank ``hpctrain / plain`` is hpctrain's overhead. Horovod runs last, in its own phase,
because its background thread slows other MPI traffic while it lives.

  hpctrain launch -n 2 -- hpctrain bench train
  mpiexec -n 2 hpctrain bench train --models mlp --steps 30 --json train.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from hpctrain import comm

COMPETITORS = ("plain", "hpctrain", "hpctrain-overlap", "hpctrain-sync", "ddp-gloo", "horovod")
MODELS = ("mlp", "cnn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpctrain bench train``."""
    p.add_argument("--models", default="mlp,cnn", help="comma list of: mlp (10.5M params), cnn (small)")
    p.add_argument("--competitors", default=",".join(COMPETITORS),
                   help="comma list of: plain, hpctrain (default settings), hpctrain-overlap (forced overlap), "
                        "hpctrain-sync (no overlap: all buckets start in step()), ddp-gloo, horovod (skipped when "
                        "not importable)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per competitor (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--fusion-threshold", default=None,
                   help="hpctrain bucket size in bytes (default: HPCTRAIN_FUSION_THRESHOLD or 4 MiB)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")


def build_model(kind: str) -> torch.nn.Module:
    """The benchmark models, identically initialized on every rank."""
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    raise SystemExit(f"bench train: unknown model {kind!r}; valid: {', '.join(MODELS)}")


def make_batch(kind: str, batch: int) -> tuple:
    g = torch.Generator().manual_seed(1234 + comm.rank())
    x = torch.randn(batch, 1024, generator=g) if kind == "mlp" else torch.randn(batch, 3, 32, 32, generator=g)
    return x, torch.randint(0, 10, (batch,), generator=g)


def _slowest(values: List[float]) -> float:
    """Median of this rank's values, then the maximum over ranks."""
    med = statistics.median(values) if values else float("nan")
    return float(comm.allreduce(torch.tensor([med], dtype=torch.float64), op="max")[0])


def run_loop(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int,
             split: bool) -> Dict[str, float]:
    """Time ``steps`` training steps after ``warmup``; with ``split``, time the parts of a
    DistributedOptimizer step (synchronize separately from the update)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    totals: List[float] = []
    computes: List[float] = []
    waits: List[float] = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        if split:
            opt.synchronize()
            t2 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
            t2 = t1
        t3 = time.perf_counter()
        if i >= warmup:
            totals.append(t3 - t0)
            computes.append((t1 - t0) + (t3 - t2))
            waits.append(t2 - t1)
    out = {"step_s": _slowest(totals)}
    if split:
        out["compute_s"] = _slowest(computes)
        out["wait_s"] = _slowest(waits)
    return out


def comm_alone(opt: Any, reps: int = 5) -> float:
    """Median seconds to all-reduce the optimizer's buckets with nothing else running."""
    times = []
    comm.barrier()
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        handles = [comm.allreduce_async(buf, op="avg", inplace=True) for buf in opt.bucket_buffers]
        for h in handles:
            h.wait()
        times.append(time.perf_counter() - t0)
    return _slowest(times[1:])


def bench_plain(kind: str, args: argparse.Namespace) -> Dict[str, float]:
    model = build_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = make_batch(kind, args.batch)
    comm.barrier()
    return run_loop(model, opt, x, y, args.steps, args.warmup, split=False)


def bench_hpctrain(kind: str, args: argparse.Namespace, overlap: Optional[bool] = None) -> Dict[str, float]:
    import hpctrain.torch as hvd

    model = build_model(kind)
    threshold = None
    if args.fusion_threshold is not None:
        from hpctrain.torch.buckets import parse_bytes

        threshold = parse_bytes(args.fusion_threshold)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), fusion_threshold=threshold,
                                   overlap=overlap)
    x, y = make_batch(kind, args.batch)
    comm.barrier()
    out = run_loop(model, opt, x, y, args.steps, args.warmup, split=True)
    out["comm_s"] = comm_alone(opt)
    out["buckets"] = len(opt.plan.buckets)
    out["overlap"] = opt._overlap
    opt.remove_hooks()
    return out


def bench_ddp(kind: str, args: argparse.Namespace) -> Optional[Dict[str, float]]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return None
    from hpctrain.torch.backends import init_torch_distributed

    init_torch_distributed("gloo")
    model = torch.nn.parallel.DistributedDataParallel(build_model(kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = make_batch(kind, args.batch)
    comm.barrier()
    return run_loop(model, opt, x, y, args.steps, args.warmup, split=False)


def horovod_module() -> Any:
    """``horovod.torch`` when it imports, else None."""
    try:
        import horovod.torch as hvd  # type: ignore
    except Exception:
        return None
    return hvd


def bench_horovod(kind: str, args: argparse.Namespace, hvd: Any) -> Dict[str, float]:
    model = build_model(kind)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = make_batch(kind, args.batch)
    hvd.allreduce(torch.zeros(1), name="bench.barrier")
    return run_loop(model, opt, x, y, args.steps, args.warmup, split=False)


def print_table(records: List[Dict[str, Any]], size: int, out: Any = sys.stdout) -> None:
    """The table, one row per (model, competitor), and the ratios the targets are stated in."""
    print(f"\nhpctrain bench train: {size} rank(s), median step of the slowest rank", file=out)
    print(f"{'model':6} {'competitor':16} {'step ms':>9} {'samples/s':>10} {'compute ms':>11} {'wait ms':>8} "
          f"{'comm ms':>8}", file=out)
    for r in records:
        def ms(key: str) -> str:
            return f"{r[key] * 1e3:.1f}" if key in r else "-"
        print(f"{r['model']:6} {r['competitor']:16} {ms('step_s'):>9} {r['samples_per_s']:>10.0f} "
              f"{ms('compute_s'):>11} {ms('wait_s'):>8} {ms('comm_s'):>8}", file=out)
    by = {(r["model"], r["competitor"]): r["step_s"] for r in records}
    for model in dict.fromkeys(r["model"] for r in records):
        mine = by.get((model, "hpctrain"))
        if mine is None:
            continue
        for other, label in (("ddp-gloo", "hpctrain/DDP-Gloo"), ("horovod", "hpctrain/Horovod"),
                             ("plain", "hpctrain/plain"), ("hpctrain-overlap", "hpctrain/hpctrain-overlap"),
                             ("hpctrain-sync", "hpctrain/hpctrain-sync")):
            if (model, other) in by:
                print(f"  {model}: {label} step ratio {mine / by[(model, other)]:.3f}", file=out)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; rank 0 prints the table."""
    comm.init()
    torch.set_num_threads(max(1, args.threads))
    models = [m for m in args.models.split(",") if m]
    wanted = [c for c in args.competitors.split(",") if c]
    bad = [c for c in wanted if c not in COMPETITORS] + [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit(f"bench train: unknown {bad}; competitors: {', '.join(COMPETITORS)}; "
                         f"models: {', '.join(MODELS)}")
    size, rank = comm.size(), comm.rank()
    records: List[Dict[str, Any]] = []

    def record(model: str, competitor: str, result: Optional[Dict[str, float]]) -> None:
        if result is None:
            return
        result = dict(result, model=model, competitor=competitor, ranks=size, batch_per_rank=args.batch,
                      samples_per_s=size * args.batch / result["step_s"])
        records.append(result)
        if rank == 0:
            print(f"  {model:4} {competitor:16} step {result['step_s'] * 1e3:8.1f} ms", flush=True)

    phases: List[tuple] = []
    for model in models:
        for competitor in ("plain", "hpctrain", "hpctrain-overlap", "hpctrain-sync", "ddp-gloo"):
            if competitor in wanted:
                phases.append((model, competitor))
    runners: Dict[str, Callable[[str, argparse.Namespace], Optional[Dict[str, float]]]] = {
        "plain": bench_plain, "hpctrain": bench_hpctrain, "ddp-gloo": bench_ddp,
        "hpctrain-overlap": lambda kind, a: bench_hpctrain(kind, a, overlap=True),
        "hpctrain-sync": lambda kind, a: bench_hpctrain(kind, a, overlap=False)}
    for model, competitor in phases:
        record(model, competitor, runners[competitor](model, args))
    if "ddp-gloo" in wanted:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if "horovod" in wanted:
        hvd = horovod_module()
        if hvd is None:
            if rank == 0:
                print("  horovod: not importable, skipped", flush=True)
        else:
            hvd.init()
            for model in models:
                record(model, "horovod", bench_horovod(model, args, hvd))
            hvd.shutdown()
    if rank == 0:
        print_table(records, size)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
            print(f"wrote {args.json}")
    return 0

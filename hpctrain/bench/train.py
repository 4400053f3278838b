"""Training-step benchmark: hpctrain's DistributedOptimizer against a plain PyTorch loop,
DDP over Gloo (torch.distributed bootstrapped through MPI) and Horovod (when importable), at
1 rank and at the launched number of ranks, in one run.

Models: an MLP 1024-2048-2048-2048-10 (10.5M parameters, 42 MB of fp32 gradients) and a small
CNN (CIFAR-sized input). Same synthetic batch per rank for every competitor (generated once, no
loader cost), SGD with momentum, ``--threads`` torch threads per rank for every competitor, the
same malloc settings for all (one process runs them all).

Phases. 1-rank rows run on rank 0 alone (a 1-rank group for hpctrain, a 1-rank process group
for DDP, a 1-rank process set for Horovod) while the other ranks wait in a barrier; N-rank rows run on every rank. Each (rank count, model,
competitor) runs ``--repeats`` times, ``--warmup`` untimed steps then ``--steps`` timed ones;
the order of the competitors rotates between repeats. Horovod runs last, in its own phase,
because its background thread slows other MPI traffic while it lives.

Columns (per row: the median over repeats of each repeat's median step of the slowest rank):

- step ms, spread (max - min of the repeat medians, ms), samples/s over all ranks;
- scaling: samples/s / (ranks x samples/s of the plain loop at 1 rank);
- compute: the step minus wait; wait: time ``synchronize()`` blocked on communication that
  backward did not hide (hpctrain, Horovod; DDP waits inside ``backward()``, not separable);
- comm: the same gradients all-reduced by that library alone, nothing else running (N ranks);
- cpu ms: CPU time of the rank's process per step, all threads (background communication
  threads, busy-waiting), slowest rank: steadier than wall time on a shared machine;
- faults: minor page faults per step (glibc malloc returning memory; ~2 us each).

``hpctrain`` uses the default settings; ``hpctrain-overlap`` forces overlap during backward,
``hpctrain-sync`` starts every bucket in ``step()``. The closing lines give the ratios that
matter when choosing hpctrain over its peers, each against the project's target for it.

  hpctrain launch -n 2 -- hpctrain bench train
  hpctrain launch -n 2 -- hpctrain bench train --models mlp --repeats 5 --json train.json
  HPCTRAIN_MALLOC_TUNING=0 hpctrain launch -n 2 -- hpctrain bench train   # glibc malloc defaults
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpctrain import comm

COMPETITORS = ("plain", "hpctrain", "hpctrain-overlap", "hpctrain-sync", "ddp-gloo", "horovod")
DEFAULT_COMPETITORS = ("plain", "hpctrain", "ddp-gloo", "horovod")
MODELS = ("mlp", "cnn")
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb, for its comm-alone measurement


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpctrain bench train``."""
    p.add_argument("--models", default="mlp,cnn", help="comma list of: mlp (10.5M params), cnn (small)")
    p.add_argument("--competitors", default=",".join(DEFAULT_COMPETITORS),
                   help="comma list of: plain, hpctrain (default settings), hpctrain-overlap (forced overlap), "
                        "hpctrain-sync (no overlap: all buckets start in step()), ddp-gloo, horovod (skipped when "
                        f"not importable). Default: {','.join(DEFAULT_COMPETITORS)}")
    p.add_argument("--ranks", default=None,
                   help="comma list of rank counts to measure, each 1 or the launched size (default: 1 and the "
                        "launched size)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each repeat (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per row, order rotated (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank, every competitor (default 1)")
    p.add_argument("--fusion-threshold", default=None,
                   help="hpctrain bucket size in bytes (default: HPCTRAIN_FUSION_THRESHOLD or 4 MiB)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows and the environment as JSON")


# ----------------------------------------------------------------------------- plan (pure)
@dataclasses.dataclass(frozen=True)
class Phase:
    """One timed run: ``repeat`` of (``ranks``, ``model``, ``competitor``)."""

    ranks: int
    model: str
    competitor: str
    repeat: int


def parse_list(text: str, valid: Sequence[str], what: str) -> List[str]:
    """``"a,b"`` -> ``["a", "b"]``, every item checked against ``valid``."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad or not items:
        raise ValueError(f"bench train: {what} {bad or text!r} not understood; valid: {', '.join(valid)}")
    return list(dict.fromkeys(items))


def parse_ranks(text: Optional[str], size: int) -> List[int]:
    """Rank counts to measure: each 1 or ``size`` (the launched size); default both."""
    if text is None:
        return sorted({1, size})
    try:
        counts = sorted({int(t) for t in str(text).split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"bench train: --ranks {text!r}: expected a comma list of integers, e.g. 1,{size}") from None
    bad = [c for c in counts if c not in (1, size)]
    if bad or not counts:
        raise ValueError(f"bench train: --ranks {text!r}: this run has {size} rank(s), so each count must be 1 or "
                         f"{size}.\nHINT: launch with more ranks (hpctrain launch -n N -- hpctrain bench train)")
    return counts


def plan_phases(rank_counts: Sequence[int], models: Sequence[str], competitors: Sequence[str],
                repeats: int) -> List[Phase]:
    """The run order: per rank count, ``repeats`` rounds over every (model, competitor), each
    round rotated by one so that no competitor always runs first or last on a drifting machine;
    Horovod after everything else (its background thread slows other MPI traffic)."""
    if repeats < 1:
        raise ValueError(f"bench train: --repeats {repeats}: expected >= 1")
    out: List[Phase] = []
    for late in (False, True):
        for ranks in rank_counts:
            pairs = [(m, c) for m in models for c in competitors if (c == "horovod") == late]
            for r in range(repeats):
                k = r % len(pairs) if pairs else 0
                out.extend(Phase(ranks, m, c, r) for m, c in pairs[k:] + pairs[:k])
    return out


def combine(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, float]:
    """One repeat's row from every participating rank's per-step lists: each rank's median,
    then the slowest rank (the step of a synchronous job is its slowest rank's)."""
    out: Dict[str, float] = {}
    for key in per_rank[0]:
        out[key] = max(statistics.median(r[key]) for r in per_rank if r.get(key))
    return out


def summarize_repeats(repeats: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Median over repeats of each field, and the spread (max - min) of the step."""
    out = {key: statistics.median(r[key] for r in repeats) for key in repeats[0]}
    steps = [r["step_s"] for r in repeats]
    out["spread_s"] = max(steps) - min(steps)
    out["repeats"] = len(repeats)
    return out


TARGETS = (
    # (label, numerator row, denominator row, kind, limit)
    ("hpctrain / DDP-Gloo step", ("hpctrain", "N"), ("ddp-gloo", "N"), "max", 0.65),
    ("hpctrain / Horovod step", ("hpctrain", "N"), ("horovod", "N"), "max", 0.55),
    ("hpctrain scaling efficiency", ("hpctrain", "N"), ("plain", 1), "scaling", 0.90),
    ("hpctrain 1-rank overhead", ("hpctrain", 1), ("plain", 1), "overhead", 0.03),
    # What communication adds over the plain loop at N ranks (each row's step minus plain's at
    # N ranks), hpctrain's against the peer's: whole-step ratios hide it behind the compute.
    ("hpctrain / DDP-Gloo added time", ("hpctrain", "N"), ("ddp-gloo", "N"), "added", 0.15),
    ("hpctrain / Horovod added time", ("hpctrain", "N"), ("horovod", "N"), "added", 0.15),
)


def target_lines(records: Sequence[Dict[str, Any]], size: int) -> List[str]:
    """The ratios of :data:`TARGETS`, per model, with met / NOT met."""
    by = {(r["model"], r["competitor"], r["ranks"]): r for r in records}
    lines = []
    for model in dict.fromkeys(r["model"] for r in records):
        for label, (num_c, num_n), (den_c, den_n), kind, limit in TARGETS:
            num_n = size if num_n == "N" else num_n
            den_n = size if den_n == "N" else den_n
            if (kind != "overhead" and size == 1) or (model, num_c, num_n) not in by \
                    or (model, den_c, den_n) not in by or (kind == "added" and (model, "plain", num_n) not in by):
                continue
            num, den = by[(model, num_c, num_n)], by[(model, den_c, den_n)]
            if kind == "added":
                lines.append(_added_time_line(model, label, num, den, by[(model, "plain", num_n)], limit))
                continue
            cpu = ""
            if num.get("cpu_s") and den.get("cpu_s") and kind != "scaling":
                cpu = f" (CPU per step: {num['cpu_s'] / den['cpu_s']:.3f})"
            if kind == "max":
                value = num["step_s"] / den["step_s"]
                ok, text, want = value <= limit, f"{value:.3f}{cpu}", f"<= {limit}"
            elif kind == "scaling":
                value = num["samples_per_s"] / (num_n * den["samples_per_s"])
                ok, text, want = value >= limit, f"{value * 100:.1f}%", f">= {limit * 100:.0f}%"
            else:
                value = num["step_s"] / den["step_s"] - 1.0
                ok, text, want = value <= limit, f"{value * 100:+.1f}%{cpu}", f"<= {limit * 100:.0f}%"
            where = f"{num_n} rank(s)" if num_n == den_n else f"{num_n} vs {den_n} rank(s)"
            lines.append(f"  {model}: {label} ({where}) {text}  target {want}: "
                         f"{'met' if ok else 'NOT met'}")
    return lines


def _added_time_line(model: str, label: str, num: Dict[str, Any], den: Dict[str, Any], plain: Dict[str, Any],
                     limit: float) -> str:
    """hpctrain's step minus the plain loop's, over the peer's step minus the plain loop's (same
    rank count). A peer no slower than the plain loop leaves no ratio to judge."""
    added, peer = num["step_s"] - plain["step_s"], den["step_s"] - plain["step_s"]
    figures = f"{added * 1e3:+.1f} ms / {peer * 1e3:+.1f} ms"
    if peer <= 0:
        return f"  {model}: {label} ({num['ranks']} rank(s)) {figures}: the peer added nothing, no ratio"
    value = max(added, 0.0) / peer
    return (f"  {model}: {label} ({num['ranks']} rank(s)) {figures} = {value:.3f}  target <= {limit}: "
            f"{'met' if value <= limit else 'NOT met'}")


def print_table(records: Sequence[Dict[str, Any]], size: int, env: Optional[Dict[str, Any]] = None,
                out: Any = sys.stdout) -> None:
    """The table (one row per rank count, model, competitor) and the target ratios."""
    print(f"\nhpctrain bench train: rows at 1 rank (rank 0 alone) and {size} ranks; median over repeats of the "
          "median step of the slowest rank", file=out)
    if env:
        for key, value in env.items():
            print(f"  {key}: {value}", file=out)
    plain1 = {r["model"]: r["samples_per_s"] for r in records if r["competitor"] == "plain" and r["ranks"] == 1}
    head = (f"{'ranks':>5} {'model':5} {'competitor':16} {'step ms':>8} {'spread':>7} {'samples/s':>9} "
            f"{'scaling':>7} {'compute':>8} {'wait':>7} {'comm':>7} {'cpu ms':>7} {'faults':>7}")
    print(head, file=out)
    for r in records:
        def ms(key: str) -> str:
            return f"{r[key] * 1e3:.1f}" if r.get(key) is not None else "-"
        scaling = (f"{r['samples_per_s'] / (r['ranks'] * plain1[r['model']]) * 100:.0f}%"
                   if r["model"] in plain1 else "-")
        faults = f"{r['faults']:.0f}" if r.get("faults") is not None else "-"
        print(f"{r['ranks']:>5} {r['model']:5} {r['competitor']:16} {ms('step_s'):>8} {ms('spread_s'):>7} "
              f"{r['samples_per_s']:>9.0f} {scaling:>7} {ms('compute_s'):>8} {ms('wait_s'):>7} {ms('comm_s'):>7} "
              f"{ms('cpu_s'):>7} {faults:>7}", file=out)
    for line in target_lines(records, size):
        print(line, file=out)


# ----------------------------------------------------------------------------- models, loop
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
    raise ValueError(f"bench train: unknown model {kind!r}; valid: {', '.join(MODELS)}")


def make_batch(kind: str, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's synthetic batch (the same for every competitor)."""
    g = torch.Generator().manual_seed(1234 + comm.rank())
    x = torch.randn(batch, 1024, generator=g) if kind == "mlp" else torch.randn(batch, 3, 32, 32, generator=g)
    return x, torch.randint(0, 10, (batch,), generator=g)


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_loop(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int,
             split: bool) -> Dict[str, List[float]]:
    """Per-step seconds of ``steps`` training steps after ``warmup``: total, compute and (with
    ``split``: an optimizer with ``synchronize()``/``skip_synchronize()``) the wait for
    communication; CPU seconds of the whole process (every thread, busy-waiting included);
    minor page faults per step."""
    loss_fn = torch.nn.CrossEntropyLoss()
    out: Dict[str, List[float]] = {"step_s": [], "compute_s": [], "cpu_s": [], "faults": []}
    if split:
        out["wait_s"] = []
    for i in range(warmup + steps):
        f0 = _minflt()
        c0 = time.process_time()
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
            out["cpu_s"].append(time.process_time() - c0)
            out["step_s"].append(t3 - t0)
            out["compute_s"].append((t1 - t0) + (t3 - t2))
            out["faults"].append(float(_minflt() - f0))
            if split:
                out["wait_s"].append(t2 - t1)
    return out


def _median_time(fn: Callable[[], None], reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# ----------------------------------------------------------------------------- competitors
class Runner:
    """A competitor's model, optimizer and batch, built once and timed repeatedly."""

    split = False  # the optimizer has synchronize() / skip_synchronize(): wait is measured
    communicates = True

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        self.model = build_model(kind)
        self.x, self.y = make_batch(kind, args.batch)
        self.opt: Any = None
        self.info: Dict[str, Any] = {}

    def time(self, steps: int, warmup: int) -> Dict[str, List[float]]:
        out = run_loop(self.model, self.opt, self.x, self.y, steps, warmup, self.split)
        if not self.split and self.communicates:
            del out["compute_s"]  # DDP: communication runs inside backward(), not separable here
        out["threads"] = [float(torch.get_num_threads())]
        return out

    def comm_alone(self) -> Optional[float]:
        """Seconds to all-reduce this competitor's gradients with nothing else running."""
        return None

    def close(self) -> None:
        pass


class Plain(Runner):
    communicates = False

    def __init__(self, kind: str, args: argparse.Namespace, group: Any) -> None:
        super().__init__(kind, args)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)


class Hpctrain(Runner):
    split = True

    def __init__(self, kind: str, args: argparse.Namespace, group: Any, overlap: Optional[bool] = None) -> None:
        import hpctrain.torch as hvd
        from hpctrain.torch.buckets import parse_bytes

        super().__init__(kind, args)
        threshold = None if args.fusion_threshold is None else parse_bytes(args.fusion_threshold)
        self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9),
                                            named_parameters=self.model.named_parameters(),
                                            fusion_threshold=threshold, overlap=overlap, process_set=group)
        self.info = {"buckets": len(self.opt.plan.buckets), "overlap": self.opt._overlap,
                     "shared_buckets": self.opt.shared_buckets}

    def comm_alone(self) -> Optional[float]:
        opt = self.opt
        ops = opt.bucket_ops

        def reduce_all() -> None:
            works = [opt._backend.allreduce_async(buf, op) for buf, op in zip(opt.bucket_buffers, ops)]
            for w in works:
                w.wait()
        return _median_time(reduce_all)

    def close(self) -> None:
        self.opt.remove_hooks()


class DDPGloo(Runner):
    def __init__(self, kind: str, args: argparse.Namespace, group: Any) -> None:
        super().__init__(kind, args)
        self.model = torch.nn.parallel.DistributedDataParallel(self.model, process_group=group)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.group = group

    def comm_alone(self) -> Optional[float]:
        import torch.distributed as dist

        numel = sum(p.numel() for p in self.model.parameters())
        flat = torch.zeros(numel)
        chunk = DDP_BUCKET_BYTES // 4
        parts = [flat[i:i + chunk] for i in range(0, numel, chunk)]

        def reduce_all() -> None:
            works = [dist.all_reduce(t, async_op=True, group=self.group) for t in parts]
            for w in works:
                w.wait()
        return _median_time(reduce_all)


class Horovod(Runner):
    split = True

    def __init__(self, kind: str, args: argparse.Namespace, hvd: Any, process_set: Any) -> None:
        super().__init__(kind, args)
        self.hvd = hvd
        self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9),
                                            named_parameters=self.model.named_parameters(),
                                            process_set=process_set)
        self.info = {"horovod_ranks": process_set.size()}

    def comm_alone(self) -> Optional[float]:
        hvd = self.hvd
        grads = [torch.zeros_like(p) for p in self.model.parameters()]

        def reduce_all() -> None:
            handles = [hvd.allreduce_async_(g, name=f"bench.comm.{i}") for i, g in enumerate(grads)]
            for h in handles:
                hvd.synchronize(h)
        return _median_time(reduce_all)


def horovod_module() -> Any:
    """``horovod.torch`` when it imports, else None."""
    try:
        import horovod.torch as hvd  # type: ignore
    except Exception:
        return None
    return hvd


def environment(threads: int) -> Dict[str, Any]:
    """What every competitor ran under (one process runs them all, so it is the same for each)."""
    from hpctrain import malloc_tuning

    env = os.environ
    set_in_env = [f"{k}={env[k]}" for k in malloc_tuning.ENV_KEYS if k in env]
    if malloc_tuning.tune_this_process():  # what `hpctrain` commands do at start; idempotent
        malloc = "thresholds 4 GiB (mallopt by hpctrain; HPCTRAIN_MALLOC_TUNING=0 for glibc's defaults)"
    elif set_in_env:
        malloc = f"{', '.join(set_in_env)} (environment, read by glibc at start)"
    else:
        malloc = "glibc defaults (HPCTRAIN_MALLOC_TUNING=0)"
    return {
        "ranks launched": comm.size(),
        "torch threads per rank": f"{torch.get_num_threads()} (--threads {threads}; OMP_NUM_THREADS="
                                  f"{env.get('OMP_NUM_THREADS', 'unset')}, MKL_NUM_THREADS="
                                  f"{env.get('MKL_NUM_THREADS', 'unset')})",
        "malloc": malloc,
        "collective checks": "on" if comm.checks_enabled() else "off (HPCTRAIN_CHECK_COLLECTIVES=0)",
        "torch": f"{torch.__version__}, BLAS {'MKL' if torch.backends.mkl.is_available() else 'other'}",
        "load average at start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }


# ----------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Run the benchmark; rank 0 prints the table."""
    comm.init()
    torch.set_num_threads(max(1, args.threads))
    bench = TrainBench(args)
    try:
        for ph in bench.phases:
            bench.run_phase(ph)
        bench.measure_comm_alone(horovod=False)
        bench.measure_comm_alone(horovod=True)
    finally:
        bench.close()
    return bench.report()


class TrainBench:
    """One run of ``hpctrain bench train``: its phases, runners and per-rank results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.size, self.rank = comm.size(), comm.rank()
        try:
            models = parse_list(args.models, MODELS, "model")
            self.wanted = parse_list(args.competitors, COMPETITORS, "competitor")
            self.rank_counts = parse_ranks(args.ranks, self.size)
            self.phases = plan_phases(self.rank_counts, models, self.wanted, args.repeats)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        self.env = environment(args.threads)
        if "horovod" in self.wanted and horovod_module() is None:
            if self.rank == 0:
                print("  horovod: not importable, skipped", flush=True)
            self.phases = [p for p in self.phases if p.competitor != "horovod"]
            self.wanted = [c for c in self.wanted if c != "horovod"]
        # Groups for the 1-rank rows (rank 0 alone); every rank takes part in creating them.
        self.solo = comm.new_group([0]) if self.size > 1 and 1 in self.rank_counts else None
        self.ddp_groups = self._ddp_groups()
        self.runners: Dict[Tuple[int, str, str], Runner] = {}
        self.results: Dict[Tuple[int, str, str], List[Dict[str, List[float]]]] = {}
        self.comm_times: Dict[Tuple[int, str, str], Optional[float]] = {}
        self.hvd: Any = None
        self.hvd_solo: Any = None

    def _ddp_groups(self) -> Dict[int, Any]:
        if "ddp-gloo" not in self.wanted:
            return {}
        import torch.distributed as dist
        from hpctrain.torch.backends import init_torch_distributed

        init_torch_distributed("gloo")
        groups: Dict[int, Any] = {self.size: None}
        if 1 in self.rank_counts:
            groups[1] = dist.new_group([0]) if self.size > 1 else None
        return groups

    def make(self, ph: Phase) -> Runner:
        args, size = self.args, self.size
        group = self.solo if ph.ranks == 1 and size > 1 else None
        if ph.competitor == "plain":
            return Plain(ph.model, args, group)
        if ph.competitor.startswith("hpctrain"):
            overlap = {"hpctrain": None, "hpctrain-overlap": True, "hpctrain-sync": False}[ph.competitor]
            return Hpctrain(ph.model, args, group, overlap)
        if ph.competitor == "ddp-gloo":
            return DDPGloo(ph.model, args, self.ddp_groups[ph.ranks])
        hvd = self.hvd
        return Horovod(ph.model, args, hvd, self.hvd_solo if ph.ranks == 1 and size > 1 else hvd.global_process_set)

    def measure_comm_alone(self, horovod: bool) -> None:
        """N-rank rows only; the others' before Horovod starts (its thread slows other MPI)."""
        for key, runner in sorted(self.runners.items()):
            if key[0] == self.size > 1 and (key[2] == "horovod") == horovod and key not in self.comm_times:
                self.comm_times[key] = runner.comm_alone()

    def start_horovod(self) -> None:
        """Horovod keeps the world of its first init() for the life of the process (a second
        init() after shutdown() does not change it), so one init serves both row kinds: the
        1-rank rows use a process set of rank 0 (Horovod's optimizer then still registers its
        hooks, as the world has several ranks; a 1-process Horovod job would skip them)."""
        self.measure_comm_alone(horovod=False)
        comm.barrier()
        hvd = self.hvd = horovod_module()
        if self.size > 1 and 1 in self.rank_counts:
            self.hvd_solo = hvd.ProcessSet([0])
            hvd.init(process_sets=[self.hvd_solo])
        else:
            hvd.init()
        if hvd.size() != self.size:
            raise RuntimeError(f"bench train: Horovod sees {hvd.size()} rank(s), this run has {self.size}; it was "
                               "initialized earlier in this process with another world.\nHINT: run the "
                               "benchmark in a fresh process")

    def run_phase(self, ph: Phase) -> None:
        key = (ph.ranks, ph.model, ph.competitor)
        if ph.competitor == "horovod" and self.hvd is None:
            self.start_horovod()
        if ph.ranks == self.size or self.rank == 0:  # 1-rank rows: rank 0 alone, the others wait below
            if key not in self.runners:
                self.runners[key] = self.make(ph)
            warmup = self.args.warmup if key not in self.results else max(1, self.args.warmup // 2)
            if ph.ranks == self.size:
                comm.barrier()
            sample = self.runners[key].time(self.args.steps, warmup)
            self.results.setdefault(key, []).append(sample)
            if self.rank == 0:
                print(f"  {ph.ranks} rank(s) {ph.model:4} {ph.competitor:16} repeat {ph.repeat + 1}: step "
                      f"{statistics.median(sample['step_s']) * 1e3:8.1f} ms (rank 0)", flush=True)
        comm.barrier()

    def close(self) -> None:
        if self.hvd is not None:
            for key in [k for k in self.runners if k[2] == "horovod"]:
                self.runners[key].close()
            self.hvd.shutdown()
        for runner in self.runners.values():
            runner.close()
        if "ddp-gloo" in self.wanted:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def report(self) -> int:
        """Every rank's per-step lists to rank 0, which takes the slowest rank per repeat."""
        everyone = comm.allgather_object({"results": self.results, "comm": self.comm_times,
                                          "info": {k: r.info for k, r in self.runners.items()}})
        if self.rank != 0:
            return 0
        records = [self._row(key, everyone) for key in self._ordered_keys()]
        self.env["load average at end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print_table(records, self.size, self.env)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"environment": self.env, "rows": records}, f, indent=1)
            print(f"wrote {self.args.json}")
        return 0

    def _ordered_keys(self) -> List[Tuple[int, str, str]]:
        order = {c: i for i, c in enumerate(COMPETITORS)}
        return sorted(self.results, key=lambda k: (k[0], MODELS.index(k[1]), order[k[2]]))

    def _row(self, key: Tuple[int, str, str], everyone: List[Dict[str, Any]]) -> Dict[str, Any]:
        ranks, model, competitor = key
        participants = [e["results"][key] for e in everyone if key in e["results"]]
        repeats = [combine([p[i] for p in participants]) for i in range(len(participants[0]))]
        row = summarize_repeats(repeats)
        row.update(model=model, competitor=competitor, ranks=ranks, batch_per_rank=self.args.batch,
                   samples_per_s=ranks * self.args.batch / row["step_s"])
        times = [e["comm"].get(key) for e in everyone if e["comm"].get(key) is not None]
        row["comm_s"] = max(times) if times else None
        row.update(everyone[0]["info"].get(key, {}))
        return row

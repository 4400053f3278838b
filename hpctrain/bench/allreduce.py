"""All-reduce benchmark: hpctrain's algorithms against the MPI library's own MPI_Allreduce,
torch.distributed Gloo and Horovod (when importable), in one run.

Every algorithm reduces the same in-place buffer (what gradient reduction does; one buffer
per size shared by all competitors, refilled before each: a copy's speed here depends on
where the buffer's pages lie). A time is
the slowest rank's mean over the calls of one timing (at least --iters; up to 1000 for small
messages, enough to move 20 MiB) after --warmup; with --repeats R the table shows the
median over repeats and the spread (min–max). Order of competitors rotates per repeat.
The reference ("best MPI") is, per size, the faster of the MPI library's in-place and
out-of-place MPI_Allreduce (mpi, mpi-oop).
busbw = algbw · 2(N−1)/N (the nccl-tests definition). Horovod runs in its own phase at the
end, since its background thread slows every other MPI call while it lives.
Where ``auto`` chooses at run time (one node, above the flag exchange; HPCTRAIN_AUTOTUNE),
its learning calls run before the timings and the table shows the share of timed calls each
candidate got, e.g. "auto(shm 87%+native 13%)".

  hpctrain launch -n 2 -- hpctrain bench allreduce --sizes 1KiB,64KiB,1MiB,16MiB,64MiB
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

from hpctrain import comm
from hpctrain.comm import tuning
from hpctrain.comm.plan import format_size, parse_size

HPCTRAIN_ALGOS = ("native", "ring", "shm", "hierarchical", "auto")
DEFAULT_ALGOS = "mpi,mpi-oop,native,ring,shm,shm-zc,hierarchical,auto,auto-check,auto-zc,gloo,horovod"
REFERENCES = ("mpi", "mpi-oop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1KiB,64KiB,1MiB,16MiB,64MiB", help="message sizes (bytes, KiB, MiB, …)")
    p.add_argument("--algos", default=DEFAULT_ALGOS,
                   help="comma list: mpi, mpi-oop (raw MPI_Allreduce in place / out of place; the faster "
                        "is the reference), native, ring, shm, hierarchical, auto (hpctrain, on the caller's "
                        "buffer), auto-check (auto with the agreement check on, the default outside the "
                        "bench), shm-zc and auto-zc (hpctrain on a buffer in the shared window: zero-copy), "
                        "gloo (torch.distributed), horovod (if importable; in its own phase)")
    p.add_argument("--iters", type=int, default=20,
                   help="calls per timing, at least (default 20); small messages get more, up to 1000, so "
                        "that each timing moves ≥ 20 MiB per rank (a 30 µs call timed 20 times is one "
                        "scheduler hiccup away from a different result)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--check", action="store_true", help="keep hpctrain's per-collective agreement check on")
    p.add_argument("--max-seconds", type=float, default=30.0,
                   help="time budget of one cell (one algorithm at one size, all repeats; default 30): "
                        "fewer calls per timing where one call is slow (e.g. across nodes over TCP)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")


def busbw_factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks if ranks > 1 else 1.0


TIMING_BYTES = 20 << 20
MAX_ITERS = 1000


def iterations(nbytes: int, at_least: int) -> int:
    """Calls per timing for messages of ``nbytes``: enough to move TIMING_BYTES (at most
    MAX_ITERS), never fewer than asked. Depends only on the size: every rank agrees."""
    return max(at_least, min(MAX_ITERS, TIMING_BYTES // max(nbytes, 1)))


def capped_iterations(iters: int, warmup: int, repeats: int, call_seconds: float, max_seconds: float) -> int:
    """Calls per timing so that a cell's ``repeats`` timings (each ``warmup`` + the calls) fit
    in ``max_seconds``, given one call's time; at least one, never more than ``iters``."""
    if call_seconds <= 0:
        return iters
    fit = int(max_seconds / (repeats * call_seconds)) - warmup
    return max(1, min(iters, fit))


def call_seconds(fn: Callable[[], None]) -> float:
    """One call's time on the slowest rank: every rank gets the same figure, so every rank
    derives the same number of calls from it."""
    with setting_of(fn):
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return timed_max(seconds)


def timed_max(seconds: float) -> float:
    return float(comm.allreduce(np.array([seconds]), op="max", algorithm="native")[0])


def timed(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """Mean seconds per call on the slowest rank."""
    with setting_of(fn):
        for _ in range(warmup):
            fn()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        seconds = (time.perf_counter() - t0) / max(iters, 1)
    return timed_max(seconds)


def setting_of(fn):
    """What must hold while ``fn`` is timed (its ``setting``, a context manager; e.g. the
    agreement check on), entered once around the timing, not paid on every call."""
    return getattr(fn, "setting", None) or contextlib.nullcontext()


def make_runners(algos: List[str], dtype: str):
    runners: Dict[str, Callable[[np.ndarray], Callable[[], None]]] = {}
    for algo in algos:
        if algo in HPCTRAIN_ALGOS:
            runners[algo] = lambda buf, a=algo: (lambda: comm.allreduce_(buf, algorithm=a))
        elif algo in ("shm-zc", "auto-zc"):
            runners[algo] = _zero_copy_runner(algo.split("-")[0])
        elif algo == "auto-check":
            runners[algo] = _checked_runner
        elif algo in REFERENCES:
            runners[algo] = _raw_mpi_runner(in_place=algo == "mpi")
        elif algo == "gloo":
            runner = _gloo_runner()
            if runner:
                runners[algo] = runner
        elif algo != "horovod":
            raise SystemExit(f"bench allreduce: unknown algorithm {algo!r}; valid: {DEFAULT_ALGOS}")
    return runners


_SHARED: Dict[tuple, object] = {}


def _zero_copy_runner(algo: str):
    def make(buf: np.ndarray):
        key = (buf.size, buf.dtype.name)
        if key not in _SHARED:  # one window per size, reused across repeats and algorithms
            _SHARED[key] = comm.shared_buffer(buf.size, buf.dtype.name)
        sbuf = _SHARED[key]
        sbuf.array[:] = buf
        return lambda: comm.allreduce_(sbuf.array, algorithm=algo)

    return make


def _checked_runner(buf: np.ndarray):
    def run():
        comm.allreduce_(buf)

    run.setting = _checks_on()
    return run


class _checks_on:
    """The agreement check on for one timing (every rank enters it at the same point), as it
    was after it (--check leaves it on for every competitor)."""

    def __enter__(self) -> None:
        self.was = comm.checks_enabled()
        comm.set_checks(True)

    def __exit__(self, *exc) -> None:
        comm.set_checks(self.was)


def _raw_mpi_runner(in_place: bool):
    from hpctrain.comm.world import world

    mpi_comm = world().comm
    from mpi4py import MPI  # noqa: the bench measures the raw library as the reference

    if in_place:
        return lambda buf: (lambda: mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))
    outputs: Dict[tuple, np.ndarray] = {}  # one output buffer per size, reused (see measure)

    def out_of_place(buf: np.ndarray):
        out = outputs.setdefault((buf.size, buf.dtype.str), np.empty_like(buf))
        return lambda: mpi_comm.Allreduce(buf, out, op=MPI.SUM)

    return out_of_place


def _gloo_runner():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=comm.rendezvous_store(), rank=comm.rank(), world_size=comm.size())
    return lambda buf: (lambda t=torch.from_numpy(buf): dist.all_reduce(t))


def _horovod_runner():
    try:
        import horovod.torch as hvd  # type: ignore
        import torch
    except Exception:
        return None, None
    hvd.init()
    return (lambda buf: (lambda t=torch.from_numpy(buf): hvd.allreduce_(t, op=hvd.Sum))), hvd


def measure(runners, sizes, dtype, args, records, on_size: Callable[[List[dict]], None] = lambda rows: None):
    """Time every runner at every size; append one record per (algo, size) to ``records`` and
    hand each size's records to ``on_size`` as soon as they are measured."""
    n = comm.size()
    names = list(runners)
    for nbytes in sizes:
        count = max(nbytes // np.dtype(dtype).itemsize, 1)
        iters = iterations(count * np.dtype(dtype).itemsize, args.iters)
        times: Dict[str, List[float]] = {a: [] for a in names}
        # One buffer per size for every competitor: a memory copy's speed here depends on
        # where its pages lie (the same 1 MiB MPI_Allreduce takes ~200 or ~550 µs depending
        # on the allocation), so each algorithm getting its own buffer would compare luck.
        buf = np.ones(count, dtype=dtype)
        chosen = {a: a for a in names}
        tuned: Dict[str, Dict[str, int]] = {a: {} for a in names}  # auto's run-time choices, per algorithm
        for algo in names:
            if algo in ("auto", "auto-check"):
                # auto's first calls of a size try each candidate (comm.tuning): learning, as
                # in a job's first steps, not its steady speed — warm it up before timing
                timed(runners[algo](buf), 0, tuning.LEARNING_CALLS)
        calls = {}
        for algo in names:
            buf.fill(1)
            calls[algo] = capped_iterations(iters, args.warmup, args.repeats, call_seconds(runners[algo](buf)),
                                            args.max_seconds)
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for algo in order:
                buf.fill(1)
                before = comm.tuned_counts(nbytes) if algo.startswith("auto") else {}
                times[algo].append(timed(runners[algo](buf), calls[algo], args.warmup))
                if algo.startswith("auto"):
                    for name, ran in comm.tuned_counts(nbytes).items():
                        tuned[algo][name] = tuned[algo].get(name, 0) + ran - before.get(name, 0)
        for algo in names:
            if algo.startswith("auto"):
                with setting_of(runners[algo](buf)):  # the route as timed (auto-check's with the check on)
                    route = comm.allreduce_route(count * np.dtype(dtype).itemsize, shared=algo == "auto-zc",
                                                 dtype=dtype)
                fixed = route.candidates[0] if route.kind == "tuned" else route.algorithm
                chosen[algo] = comm.broadcast_object(chosen_label(fixed, tuned[algo]))
        rows = []
        for algo in names:
            t = statistics.median(times[algo])
            algbw = count * np.dtype(dtype).itemsize / t / 1e9
            rows.append({
                "algo": algo, "bytes": int(count * np.dtype(dtype).itemsize), "ranks": n, "dtype": dtype,
                "iters": calls[algo],
                "time_s": t, "time_min_s": min(times[algo]), "time_max_s": max(times[algo]),
                "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(n),
                "chosen": chosen[algo],
            })
        records.extend(rows)
        on_size(rows)


def chosen_label(fixed: str, counts: Dict[str, int]) -> str:
    """What ``auto`` ran: the fixed choice, or the run-time choices as shares of the calls
    ("shm 94%+native 6%"), most used first."""
    total = sum(counts.values())
    if not total:
        return fixed
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return "+".join(f"{name} {100 * n / total:.0f}%" for name, n in ranked if n)


def layout_line() -> str:
    g = comm.world()
    nodes = [g.topology.ranks_on(i) for i in range(g.topology.num_nodes)]
    hosts = comm.allgather_object(comm.hostname())
    parts = [f"{hosts[r[0]]}:{r}" for r in nodes]
    return f"ranks={g.size} nodes={len(nodes)} layout: " + "  ".join(parts)


def reference_times(records: List[dict]) -> Dict[int, float]:
    """Per size, the time of the best MPI_Allreduce variant measured (in place or out of
    place); hpctrain's native path when no raw reference ran."""
    names = [n for n in REFERENCES if any(r["algo"] == n for r in records)] or ["native"]
    best: Dict[int, float] = {}
    for r in records:
        if r["algo"] in names:
            best[r["bytes"]] = min(best.get(r["bytes"], float("inf")), r["time_s"])
    return best


def ratios_against(records: List[dict], competitor: str) -> Dict[tuple, float]:
    """(algo, bytes) → competitor's time / algo's time (>1: algo is faster)."""
    theirs = {r["bytes"]: r["time_s"] for r in records if r["algo"] == competitor}
    return {(r["algo"], r["bytes"]): theirs[r["bytes"]] / r["time_s"] for r in records if r["bytes"] in theirs}


def print_header(competitors: List[str], out=sys.stdout) -> None:
    print(f"{'size':>8} {'algo':>30} {'time_us':>10} {'spread_us':>15} {'algbw':>7} {'busbw':>7} "
          f"{'x_best_mpi':>10}" + "".join(f" {'x_' + c:>9}" for c in competitors), file=out, flush=True)


def print_rows(rows: List[dict], records: List[dict], competitors: List[str], out=sys.stdout) -> None:
    """``rows`` (one size's records) against the references and ``competitors`` found in ``records``."""
    ref = reference_times(records)
    vs = {c: ratios_against(records, c) for c in competitors}
    for r in rows:
        ratio = ref[r["bytes"]] / r["time_s"] if r["bytes"] in ref else float("nan")
        spread = f"{r['time_min_s'] * 1e6:.0f}-{r['time_max_s'] * 1e6:.0f}"
        algo = r["algo"] + (f"({r['chosen']})" if r["algo"].startswith("auto") else "")
        others = "".join(f" {vs[c].get((r['algo'], r['bytes']), float('nan')):>9.2f}" for c in competitors)
        print(f"{format_size(r['bytes']):>8} {algo:>30} {r['time_s'] * 1e6:>10.1f} {spread:>15} "
              f"{r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f} {ratio:>10.2f}{others}", file=out, flush=True)


def print_versus(records: List[dict], competitor: str, out=sys.stdout) -> None:
    """After a competitor measured in its own phase: every other row's ratio against it."""
    vs = ratios_against(records, competitor)
    print(f"against {competitor} (its time / this one's; >1: faster than {competitor}):", file=out)
    for r in records:
        if r["algo"] != competitor and (r["algo"], r["bytes"]) in vs:
            print(f"{format_size(r['bytes']):>8} {r['algo']:>30} {vs[(r['algo'], r['bytes'])]:>9.2f}", file=out)


def run(args: argparse.Namespace) -> int:
    comm.init()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    was_checking = comm.checks_enabled()
    comm.set_checks(args.check)
    records: List[dict] = []
    layout = layout_line()
    runners = make_runners(algos, args.dtype)
    competitors = ["gloo"] if "gloo" in runners else []
    lead = comm.rank() == 0
    if lead:
        print(f"hpctrain bench allreduce: {layout}; dtype={args.dtype} iters>={args.iters} (more for small messages, "
              f"fewer where a cell would pass --max-seconds={args.max_seconds:g}) warmup={args.warmup} "
              f"repeats={args.repeats} agreement-check={'on' if args.check else 'off'}", flush=True)
        print_header(competitors)
    # each size's rows print as soon as they are measured: across nodes a run takes minutes
    show = (lambda rows: print_rows(rows, records, competitors)) if lead else (lambda rows: None)
    measure(runners, sizes, args.dtype, args, records, show)
    if "horovod" in algos:
        runner, hvd = _horovod_runner()
        if runner is not None:
            measure({"horovod": runner}, sizes, args.dtype, args, records, show)
            hvd.shutdown()
            if lead:
                print_versus(records, "horovod")
        elif lead:
            print("horovod: not importable, skipped (build it with benchmarks/build_horovod.sh)")
    comm.set_checks(was_checking)
    if lead and args.json:
        for r in records:
            r["layout"] = layout
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return 0

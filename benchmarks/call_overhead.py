"""What hpctrain's all-reduce costs around the MPI call it runs: one call at a time, in turn.

For each size, every round runs a short block of calls of each competitor on the same
buffer (--block, default 8), in an order that rotates per round, each call after a barrier
and timed alone (rank 0's clock): the host's drift (up to 2x within a minute on a small VM)
then falls on all of them alike, where `hpctrain bench allreduce` times each competitor's
calls in one long block. The first call of each block is not counted: it pays for the switch
from the previous competitor's algorithm (the piped path's first call after MPI_Allreduce
took 10-30% more; MPI_Allreduce's after the piped path up to 3.5x), and with one call per
round a cyclic rotation put every competitor after the same one every time.
Competitors: the MPI library's MPI_Allreduce in place (`mpi`), hpctrain's `auto` with the
agreement check on and off, and `native` (MPI_Allreduce forced through the general path)
with the check on. Before the rounds, `auto` runs enough calls to finish its run-time
tuner's first trials. Prints the median, the 10th percentile and the ratio of medians
(MPI / competitor: above 1, faster than MPI), and how often the tuner picked each candidate.

  hpctrain launch -n 2 -- python benchmarks/call_overhead.py --sizes 4MiB,8MiB --rounds 60
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from hpctrain import comm
from hpctrain.comm.plan import parse_size


def competitors(x: np.ndarray, mpi_comm) -> dict:
    def checked(on: bool, fn):
        def run():
            comm.set_checks(on)
            fn()
        return run

    return {
        "mpi": lambda: mpi_comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
        "auto-check": checked(True, lambda: comm.allreduce_(x)),
        "auto": checked(False, lambda: comm.allreduce_(x)),
        "native-check": checked(True, lambda: comm.allreduce_(x, algorithm="native")),
    }


def rounds(runs: dict, count: int, block: int, barrier) -> dict:
    """Per competitor, the times of its calls but the first of each block."""
    names = list(runs)
    times = {name: [] for name in names}
    for i in range(count):
        for name in names[i % len(names):] + names[:i % len(names)]:
            for j in range(block):
                barrier()
                start = time.perf_counter()
                runs[name]()
                if j:
                    times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB,4MiB,8MiB", help="message sizes (float32)")
    p.add_argument("--rounds", type=int, default=60, help="blocks of each competitor per size")
    p.add_argument("--block", type=int, default=8, help="calls per block, the first not counted (at least 2)")
    args = p.parse_args()
    if args.block < 2 or args.rounds < 1:
        p.error("--block must be at least 2 and --rounds at least 1")
    comm.init()
    mpi_comm = comm.world().comm
    checks = comm.checks_enabled()
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)
        runs = competitors(x, mpi_comm)
        for _ in range(100):  # the tuner's first trials, and every competitor's first calls
            runs["auto-check"]()
        for run in runs.values():
            run()
        before = comm.tuned_counts(nbytes)
        times = rounds(runs, args.rounds, args.block, mpi_comm.Barrier)
        comm.set_checks(checks)
        if comm.rank() == 0:
            picks = {name: ran - before.get(name, 0) for name, ran in comm.tuned_counts(nbytes).items()}
            if picks:
                print(f"{nbytes:>10} auto's picks in the rounds (both checks): {picks}")
            reference = np.median(times["mpi"])
            for name, values in times.items():
                us = np.array(values) * 1e6
                print(f"{nbytes:>10} {name:13s} median {np.median(us):9.1f} µs  p10 {np.percentile(us, 10):9.1f} µs"
                      f"  x_mpi {reference / np.median(values):5.2f}", flush=True)


if __name__ == "__main__":
    main()

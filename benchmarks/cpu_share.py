"""Whether all-reduces are bound by the host's CPU: per algorithm and size, the wall time of a
call, the CPU time all ranks spent on it (user + system, every thread) and the machine's busy
share over the timing (/proc/stat). Where the ranks' CPU time equals cores × wall time, every
core is busy: a call then costs its CPU work divided by the cores, and only less work (fewer
copies, fewer bytes through the network stack) makes it faster.

  mpiexec -n 4 ... python benchmarks/cpu_share.py --sizes 4MiB,64MiB --cores 2 \
      --algos mpi,hierarchical,hierarchical-zc,transfer
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from hpctrain import comm  # before mpi4py: hpctrain.comm sets its Open MPI defaults first
from hpctrain.comm.plan import parse_size


def busy_jiffies() -> tuple:
    """(busy, total) jiffies of every CPU so far, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)  # idle and iowait are not busy


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def transfer(world, x: np.ndarray, local_size: int, nodes: int):
    """A call that swaps half of ``x`` with the same local rank on the other node."""
    if nodes != 2:
        raise SystemExit("cpu_share.py: transfer needs exactly two nodes")
    partner = (world.Get_rank() + local_size) % world.Get_size()
    half = x[:x.size // 2]
    scratch = np.empty_like(half)
    return lambda: world.Sendrecv(half, dest=partner, recvbuf=scratch, source=partner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4MiB,64MiB", help="message sizes (float32)")
    p.add_argument("--algos", default="mpi,hierarchical,ring,hierarchical-zc",
                   help="mpi (MPI_Allreduce), hpctrain algorithms (NAME-zc: on a buffer in the node's shared "
                        "window) or transfer (two nodes: each rank swaps half the buffer with its "
                        "counterpart on the other node, no reduction: the bytes the hierarchical "
                        "path sends across nodes)")
    p.add_argument("--cores", type=int, required=True, help="cores the ranks share (all nodes together)")
    p.add_argument("--bytes", default="256MiB", help="bytes each timing reduces, at least 4 calls")
    args = p.parse_args()
    comm.init()
    from mpi4py import MPI

    world = comm.world().comm
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        private = np.ones(nbytes // 4, np.float32)
        shared = comm.shared_buffer(private.shape, "float32")
        shared.array[:] = 1
        calls = max(4, parse_size(args.bytes) // nbytes)
        for algo in args.algos.split(",") * 2:  # twice, alternating: the host drifts
            x = shared.array if algo.endswith("-zc") else private
            if algo == "mpi":
                run = lambda: world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # noqa: E731
            elif algo == "transfer":
                run = transfer(world, private, comm.local_size(), comm.cross_size())
            else:
                run = lambda x=x, algo=algo.removesuffix("-zc"): comm.allreduce_(x, algorithm=algo)  # noqa: E731
            run()
            run()
            world.Barrier()
            jiffies, cpu, start = busy_jiffies(), cpu_seconds(), time.perf_counter()
            for _ in range(calls):
                run()
            world.Barrier()
            wall = time.perf_counter() - start
            busy, total = (a - b for a, b in zip(busy_jiffies(), jiffies))
            ranks_cpu = world.allreduce(cpu_seconds() - cpu)
            if comm.rank() == 0:
                print(f"{nbytes:>10} {algo:13s} {wall / calls * 1e3:9.2f} ms/call  ranks' CPU "
                      f"{ranks_cpu / calls * 1e3:9.2f} ms/call = {ranks_cpu / (args.cores * wall):6.1%} of "
                      f"{args.cores} cores; machine busy {busy / max(total, 1):6.1%}", flush=True)
        comm.free_shared_buffer(shared)


if __name__ == "__main__":
    main()

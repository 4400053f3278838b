"""The agreement check's schedule across nodes: node leaders against every rank in the doubling.

Small `auto` all-reduces across nodes travel in the agreement check's messages. Across nodes
the check folds each node's ranks into the node's leader along a binomial tree, the leaders
swap by recursive doubling, and the result goes back down (hpctrain.comm.plan.check_schedule);
the alternative is recursive doubling over every rank, where every rank's part crosses the
network. This runs both in one process, in alternating blocks of calls (the order rotating
per round), with the MPI library's MPI_Allreduce in place beside them, and prints the median
time per call and the ratios. Run it across nodes (on one node the flat schedule is the only
one, and with the shared-memory flags the check does not go through MPI at all):

  mpiexec -n 4 --host node1:2,node2:2 python benchmarks/check_schedule.py --sizes 1KiB,16KiB,64KiB,256KiB

(docs/performance.md gives the namespace-cluster command line.)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from hpctrain import comm  # before mpi4py's MPI: it sets the MPI defaults (no osc/ucx noise)
from hpctrain.comm import collectives, guard
from hpctrain.comm.plan import check_schedule, parse_size
from mpi4py import MPI  # after hpctrain.comm (above)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1KiB,16KiB,64KiB,256KiB", help="message sizes (comma-separated)")
    p.add_argument("--rounds", type=int, default=6, help="rounds of one block per competitor (median over them)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per block (three tenths of it from 128 KiB)")
    args = p.parse_args()
    comm.init()
    comm.set_checks(True)
    g = collectives._world_state["world"]
    if g.topology.single_node:
        raise SystemExit("check_schedule.py: the ranks share one node; run it across nodes")
    node_of = g.topology.node_of
    schedules = {"leaders": check_schedule(g.rank, g.size, node_of), "every rank": check_schedule(g.rank, g.size)}
    # the same in-band limit for both (the check's rows are sized by it at first use)
    g.inband = min(guard.inband_limit(g.inband, g.size, node_of), guard.inband_limit(g.inband, g.size))
    g.check_io = None
    world = MPI.COMM_WORLD
    if g.rank == 0:
        print(f"ranks={g.size} nodes={g.topology.num_nodes} in-band limit={g.inband} B; median µs per call")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        if nbytes > g.inband:
            if g.rank == 0:
                print(f"{nbytes:>9} B: above the in-band limit, skipped")
            continue
        times = _rounds(g, world, schedules, np.ones(nbytes // 4, np.float32), args.rounds,
                        args.calls if nbytes < 128 * 1024 else max(1, args.calls * 3 // 10))
        if g.rank == 0:
            m = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
            print(f"{nbytes:>9} B  leaders {m['leaders']:8.1f}  every rank {m['every rank']:8.1f}  "
                  f"MPI_Allreduce {m['mpi']:8.1f}   every rank / leaders {m['every rank'] / m['leaders']:.2f}  "
                  f"MPI / leaders {m['mpi'] / m['leaders']:.2f}", flush=True)


def _use(g, schedule) -> None:
    """Every rank switches at the same call: the cached calls are rebuilt on the new schedule."""
    g.check_schedule = schedule
    g.routes.clear()
    if g.check_io is not None:
        g.check_io.plain = None


def _rounds(g, world, schedules: dict, x: np.ndarray, rounds: int, calls: int) -> dict:
    names = [*schedules, "mpi"]
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name == "mpi":
                call = lambda: world.Allreduce(MPI.IN_PLACE, x)  # noqa: E731
            else:
                _use(g, schedules[name])
                call = lambda: comm.allreduce_(x)  # noqa: E731
            for _ in range(10):  # the switch and its first calls are not timed
                call()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - start) / calls)
    _use(g, schedules["leaders"])
    return times


if __name__ == "__main__":
    main()

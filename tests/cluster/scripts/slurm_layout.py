"""Job payload for the multi-node SLURM tests: where every rank runs, as MPI/hpctrain.comm
and as SLURM's environment (hpctrain.slurm.env) see it, plus a cross-node all-reduce.

Rank 0 prints ``SLURM-LAYOUT {json}`` with one row per rank; exits 1 when the all-reduce or
the world size is wrong.
"""
import json
import socket
import sys

import numpy as np

from hpctrain import comm
from hpctrain.slurm import env as slurm_env


def main() -> int:
    comm.init()
    view = slurm_env.from_environ()
    x = np.full(1100007, comm.rank() + 1.0, dtype=np.float32)  # > 4 MiB: auto runs the hierarchical path across nodes
    total = comm.allreduce(x, algorithm="auto")
    ok = bool(np.all(total == comm.size() * (comm.size() + 1) / 2))
    row = {
        "rank": comm.rank(), "size": comm.size(), "hostname": socket.gethostname(),
        "local_rank": comm.local_rank(), "local_size": comm.local_size(),
        "cross_rank": comm.cross_rank(), "cross_size": comm.cross_size(),
        "slurm": None if view is None else {
            "rank": view.rank, "size": view.size, "local_rank": view.local_rank,
            "node_rank": view.node_rank, "num_nodes": view.num_nodes, "nodes": view.nodes,
            "launcher": view.launcher, "master_addr": view.master_addr,
        },
        "auto": comm.choose_algorithm(x.nbytes), "allreduce_ok": ok,
    }
    rows = comm.allgather_object(row)
    if comm.rank() == 0:
        print("SLURM-LAYOUT " + json.dumps(rows), flush=True)
    return 0 if all(r["allreduce_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

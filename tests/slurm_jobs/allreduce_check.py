"""Job payload for the SLURM tests: an all-reduce over every rank, checked against the
expected sum, plus hpctrain.slurm's view of the rank (which must match MPI's).

Prints, on rank 0: ``allreduce-check OK world=N sum=S expected=E launcher=L``; exits 1 on
any mismatch. Under plain ``srun`` (no --mpi=pmix) comm.init() must fail with a HINT.
"""
import sys

import numpy as np

from hpctrain import comm
from hpctrain.slurm import env as slurm_env


def main() -> int:
    comm.init()
    rank, size = comm.rank(), comm.size()
    total = float(comm.allreduce(np.array([rank + 1.0]))[0])
    expected = size * (size + 1) / 2
    view = slurm_env.from_environ()
    problems = []
    if view is None:
        problems.append("not inside a SLURM job")
    elif (view.rank, view.size) != (rank, size):
        problems.append(f"hpctrain.slurm.env says rank {view.rank}/{view.size}, MPI says {rank}/{size}")
    if total != expected:
        problems.append(f"sum {total} != expected {expected}")
    views = comm.allgather_object((rank, view.launcher if view else None, view.local_rank if view else None, problems))
    if rank == 0:
        for r, launcher, local, probs in views:
            print(f"rank {r}: launcher={launcher} local_rank={local} {'; '.join(probs) or 'ok'}")
        bad = any(p for *_, p in views)
        print(f"allreduce-check {'FAILED' if bad else 'OK'} world={size} sum={total} expected={expected} "
              f"launcher={view.launcher if view else None}", flush=True)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

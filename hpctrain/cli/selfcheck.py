"""``hpctrain selfcheck``: run every all-reduce algorithm on this job's ranks and compare it
with the MPI library's own MPI_Allreduce. Prints one line per rank 0 and exits non-zero on
any difference. Use it as the first step of a new cluster job:

  srun --mpi=pmix -n 4 hpctrain selfcheck
  mpirun -n 4 hpctrain selfcheck
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("selfcheck", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fail-on-rank", type=int, default=None, help=argparse.SUPPRESS)  # fault-injection tests
    p.set_defaults(func=run)


def check_all(comm) -> list:
    """Return the list of (algorithm, dtype, length) that disagree with MPI_Allreduce."""
    import numpy as np

    n, r = comm.size(), comm.rank()
    bad = []
    for algo in comm.ALGORITHMS:
        for dtype in ("float32", "float64", "int32", "float16"):
            for length in sorted({0, 1, n + 1, 100_003}):
                x = ((np.arange(length) * 7 + r) % 13).astype(dtype)
                got = comm.allreduce(x, algorithm=algo)
                want = comm.allreduce(x, algorithm="native")
                if not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3 if dtype == "float16" else 1e-6):
                    bad.append((algo, dtype, length))
    return bad


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from hpctrain import comm

    comm.init()
    if args.fail_on_rank is not None and comm.rank() == args.fail_on_rank:
        raise RuntimeError(f"--fail-on-rank {args.fail_on_rank}: injected failure")
    bad = check_all(comm)
    total = comm.allreduce(np.array([comm.rank() + 1.0]))[0]
    bad_all = comm.allgather_object(bad)
    if comm.rank() == 0:
        n = comm.size()
        problems = sorted({b for per_rank in bad_all for b in per_rank})
        status = "OK" if not problems and total == n * (n + 1) / 2 else "FAILED"
        print(f"selfcheck {status} world={n} nodes={comm.cross_size()} local_size={comm.local_size()} "
              f"sum(rank+1)={total:g} algorithms={','.join(comm.ALGORITHMS)} host={comm.hostname()}", flush=True)
        for p in problems:
            print(f"  mismatch: algorithm={p[0]} dtype={p[1]} length={p[2]}")
    ok = comm.broadcast_object(not any(bad_all))
    return 0 if ok else 1

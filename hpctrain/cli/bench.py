"""``hpctrain bench <what>``: benchmarks, measured as ratios side by side in one run.

Each benchmark lives in ``hpctrain.bench.<what>`` with ``add_arguments(parser)`` and
``run(args) -> int``. Run them under mpiexec/srun for several ranks.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "allreduce": "all-reduce algorithms vs MPI_Allreduce, Gloo and Horovod",
    "train": "training step time vs plain PyTorch, DDP-Gloo and Horovod",
    "data": "HDF5 loader vs raw slab reads and per-sample indexing",
    "pipeline": "pipeline-parallel throughput vs micro-batch count",
}

EPILOG = """examples:
  hpctrain launch -n 2 -- hpctrain bench allreduce --sizes 1KiB,1MiB,64MiB --json out.json
  mpiexec -n 2 hpctrain bench train
  hpctrain bench data --size 1GiB
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("bench", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    inner = p.add_subparsers(dest="bench", metavar="WHAT")
    for name, text in BENCHES.items():
        try:
            module = importlib.import_module(f"hpctrain.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hpctrain.bench.{name}":
                raise
            continue
        q = inner.add_parser(name, help=text, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q)
        q.set_defaults(func=module.run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

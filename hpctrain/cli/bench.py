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
    "calibrate": "measure a config's compute and links: the profile `hpctrain plan` reads",
}

EPILOG = """examples:
  hpctrain launch -n 2 -- hpctrain bench allreduce --sizes 1KiB,1MiB,64MiB --json out.json
  mpiexec -n 2 hpctrain bench train
  hpctrain bench data --size 1GiB
  mpiexec -n 2 hpctrain bench calibrate config.yaml --out profile.json
"""


class _BenchParser(argparse.ArgumentParser):
    """One benchmark's parser. Its module (torch and all) is imported when this parser is
    used, not when `hpctrain bench --help` lists the benchmarks."""

    bench_module = ""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self.bench_module:
            module = importlib.import_module(self.bench_module)
            self.bench_module = ""
            self.description = module.__doc__
            module.add_arguments(self)
            self.set_defaults(func=module.run)
        return super().parse_known_args(args, namespace)


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("bench", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    inner = p.add_subparsers(dest="bench", metavar="WHAT", parser_class=_BenchParser)
    for name, text in BENCHES.items():
        q = inner.add_parser(name, help=text, formatter_class=argparse.RawDescriptionHelpFormatter)
        q.bench_module = f"hpctrain.bench.{name}"
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

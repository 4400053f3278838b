"""``hpctrain <verb>``: one module per verb under ``hpctrain.cli``, imported only when used.

Each verb module defines ``register(subparsers)`` that adds its parser and sets
``func=run`` on it. An unhandled exception on any rank aborts the whole MPI job (printing
the rank and traceback) instead of leaving the other ranks hanging in a collective.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# verb -> (module, one-line help). Only the module of the verb asked for is imported, so that
# `hpctrain --help` is fast and a verb whose optional dependency is missing does not break
# the others.
VERBS = {
    "launch": ("hpctrain.cli.launch", "run a command on N ranks with this machine's mpiexec"),
    "bench": ("hpctrain.cli.bench", "benchmarks: allreduce, train, data, pipeline, calibrate"),
    "plan": ("hpctrain.cli.plan", "predict step time and efficiency on N nodes"),
    "probe": ("hpctrain.cli.probe", "show the hardware each rank sees; tune the batch size"),
    "data": ("hpctrain.cli.data", "HDF5 tools: pack, shard, inspect, verify, merge"),
    "slurm": ("hpctrain.cli.slurm", "sbatch templates: render, submit; status, logs, cancel"),
    "train": ("hpctrain.cli.train", "train a model from a YAML config"),
    "report": ("hpctrain.cli.report", "plots and a summary of a run directory"),
    "export": ("hpctrain.cli.export", "write a run's trained model as a state_dict / TorchScript"),
    "selfcheck": ("hpctrain.cli.selfcheck", "check every all-reduce algorithm against MPI_Allreduce"),
}

EPILOG = """examples:
  hpctrain launch -n 2 -- hpctrain selfcheck
  mpiexec -n 4 hpctrain bench allreduce --sizes 1KiB,1MiB,64MiB
  hpctrain <verb> --help
"""


def build_parser(verb: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser with ``verb``'s module imported and registered; every other verb (all of
    them when ``verb`` is None: ``hpctrain --help``) is listed by name and help text only, so
    that nothing of a verb (torch, mpi4py, h5py) loads before it is asked for."""
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Train PyTorch models on HPC clusters over MPI.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from hpctrain import __version__

    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module_name, help_text) in VERBS.items():
        if name == verb:
            importlib.import_module(module_name).register(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in VERBS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from hpctrain import settings
    from hpctrain.comm.abort import run_or_abort
    from hpctrain.comm.errors import WorldSizeError
    from hpctrain.extras import MissingExtraError
    from hpctrain.malloc_tuning import tune_this_process

    try:  # every HPCTRAIN_* variable, before anything runs: a bad one is one line, not a traceback
        settings.check_all()
    except settings.SettingError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2

    tune_this_process()
    try:
        return run_or_abort(args.func, args)
    except (MissingExtraError, WorldSizeError) as exc:
        # A missing extra, or a world-size error raised in comm.init() before any rank could
        # talk to another (every process prints it: each is a world of its own): one error
        # line, not a traceback.
        print(f"hpctrain {args.verb}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

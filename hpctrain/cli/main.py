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

# verb -> (module, one-line help). Modules are imported lazily so `hpctrain --help` is fast
# and a verb whose optional dependency is missing does not break the others.
VERBS = {
    "launch": ("hpctrain.cli.launch", "run a command on N ranks with this machine's mpiexec"),
    "bench": ("hpctrain.cli.bench", "benchmarks: allreduce, train, data, pipeline"),
    "probe": ("hpctrain.cli.probe", "show the hardware each rank sees; tune the batch size"),
    "data": ("hpctrain.cli.data", "HDF5 tools: pack, shard, inspect, verify, merge"),
    "slurm": ("hpctrain.cli.slurm", "render and submit sbatch templates"),
    "train": ("hpctrain.cli.train", "train a model from a YAML config"),
    "report": ("hpctrain.cli.report", "plots and a summary of a run directory"),
    "selfcheck": ("hpctrain.cli.selfcheck", "check every all-reduce algorithm against MPI_Allreduce"),
}

EPILOG = """examples:
  hpctrain launch -n 2 -- hpctrain selfcheck
  mpiexec -n 4 hpctrain bench allreduce --sizes 1KiB,1MiB,64MiB
  hpctrain <verb> --help
"""


def build_parser(verbs: Optional[List[str]] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Train PyTorch models on HPC clusters over MPI.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from hpctrain import __version__

    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in verbs or VERBS:
        module_name, help_text = VERBS[verb]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # verb not built yet
        module.register(sub, help_text)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the verb asked for (plus nothing else) when it is known.
    verbs = [argv[0]] if argv and argv[0] in VERBS else None
    parser = build_parser(verbs)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from hpctrain import settings
    from hpctrain.comm.abort import run_or_abort
    from hpctrain.malloc_tuning import tune_this_process

    try:  # every HPCTRAIN_* variable, before anything runs: a bad one is one line, not a traceback
        settings.check_all()
    except settings.SettingError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2

    tune_this_process()

    return run_or_abort(args.func, args)


if __name__ == "__main__":
    sys.exit(main())

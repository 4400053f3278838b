"""``hpctrain report RUN_DIR``: PNG plots (loss and accuracy, throughput, compute vs.
communication per rank, per-rank step time) and a short text summary of a training run."""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  hpctrain report runs/digits
  hpctrain report runs/digits --out /tmp/plots
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("report", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of `hpctrain train` (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the plots (default RUN_DIR/report)")
    p.set_defaults(func=run, no_mpi=True)


def run(args: argparse.Namespace) -> int:
    from hpctrain.train.report import ReportError, make_report

    try:
        rep = make_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"hpctrain report: {exc}", file=sys.stderr)
        return 2
    print(rep["text"], end="")
    print("wrote " + ", ".join(rep["files"]))
    return 0

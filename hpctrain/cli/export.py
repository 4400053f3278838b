"""``hpctrain export RUN_DIR -o model.pt``: the trained model as a plain ``state_dict`` (tensors
only, loads with ``torch.load(weights_only=True)``) and, with ``--torchscript``, as TorchScript
with the run's input normalisation built in; with ``--torch-export``, as ``torch.export``'s
ExportedProgram (``.pt2``), also with it.

Loading it back in Python: ``hpctrain.load_model(RUN_DIR)`` (see docs/train.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """examples:
  hpctrain export runs/digits -o digits.pt
  hpctrain export runs/digits --best -o digits-best.pt --torchscript
  hpctrain export runs/digits -o digits.pt --torch-export
  hpctrain export runs/digits --checkpoint runs/digits/checkpoints/ckpt-000000400.pt -o m.pt --torchscript m.ts
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("export", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of `hpctrain train` (or its checkpoint dir)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true",
                       help="the best checkpoint (file with 'best' in its name) instead of the newest")
    which.add_argument("--checkpoint", metavar="PATH", help="this checkpoint file (or pipeline-<step>/ directory)")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="where to write the state_dict, e.g. model.pt")
    p.add_argument("--torchscript", nargs="?", const="", default=None, metavar="FILE",
                   help="also write TorchScript (default file: <out stem>.torchscript.pt)")
    p.add_argument("--torch-export", nargs="?", const="", default=None, metavar="FILE", dest="program",
                   help="also write torch.export's ExportedProgram (default file: <out stem>.pt2; "
                        "reads the input shape from the run's data)")
    p.set_defaults(func=run, no_mpi=True)


def run(args: argparse.Namespace) -> int:
    from hpctrain.train.export import ExportError, export

    out = Path(args.out)
    ts = None
    if args.torchscript is not None:
        ts = args.torchscript or str(out.with_name(out.stem + ".torchscript.pt"))
    program = None
    if args.program is not None:
        program = args.program or str(out.with_name(out.stem + ".pt2"))
    try:
        done = export(args.run_dir, out, best=args.best, checkpoint=args.checkpoint, torchscript=ts, program=program)
    except ExportError as exc:
        print(f"hpctrain export: {exc}", file=sys.stderr)
        return 2
    print(f"hpctrain export: checkpoint {done.checkpoint} (step {done.step})", file=sys.stderr)
    print(f"state_dict: {done.state_dict}")
    if done.normalize is not None:
        print(f"input normalisation (x - shift) / scale, not in the state_dict: {done.normalize}")
    if done.torchscript is not None:
        print(f"torchscript: {done.torchscript}")
    if done.program is not None:
        print(f"torch.export program: {done.program}")
    return 0

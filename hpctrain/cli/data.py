"""``hpctrain data <pack|shard|inspect|verify|merge>``: HDF5 tools (also ``data_tools/*.py``).

Every output is written under a temporary name in the target directory and renamed when
complete, so an interrupted run never leaves a half-written file. Bad input ends with one
error line naming the file and key (exit code 2); ``verify`` exits 1 when it finds problems.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, Optional

EXAMPLES = """examples:
  hpctrain data pack digits --out digits.h5 --compression lzf --fletcher32
  hpctrain data pack features.npy labels.npy --out train.h5
  hpctrain data pack --x X_train.npy --y y_train.npy --out train.h5
  hpctrain data pack images/ --out images.h5               # images/<class>/<file>.png
  hpctrain data pack table.csv --label-column target --out table.h5
  hpctrain data shard train.h5 --num-shards 8 --out shards/
  mpiexec -n 4 hpctrain data shard train.h5 --num-shards 8 --out shards/   # each rank writes 2
  hpctrain data inspect shards/ --json
  hpctrain data verify shards/
  hpctrain data merge shards/ --out train-again.h5
"""


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def add_verbs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", help="pack .npy/.npz/CSV files or the sklearn digits set into one chunked HDF5 file",
                       description="Pack inputs into one chunked HDF5 file with metadata and sha256 checksums.",
                       epilog="example:\n  hpctrain data pack digits --out digits.h5 --compression gzip --shuffle",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="'digits' (scikit-learn's digits set), FILE.npy (key = file stem), FILE.npz, FILE.csv, "
                        "FILE.parquet/.feather, FILE.h5/.nc (its sample keys, or --keys), DIR of class "
                        "subfolders of images; a key found in several inputs is concatenated")
    p.add_argument("--x", nargs="+", default=[], metavar="FILE", help="files (one array each) concatenated "
                   "into key 'x', recorded as the input role")
    p.add_argument("--y", nargs="+", default=[], metavar="FILE", help="files (one array each) concatenated "
                   "into key 'y', recorded as the target role")
    p.add_argument("--keys", help="HDF5/netCDF inputs: comma-separated datasets to take (nested paths allowed)")
    p.add_argument("--roles", metavar="x=KEY,y=KEY", help="record these keys as the input (x) and target (y) "
                   "without renaming them, so a training config needs no data.keys (default: keys named x, y)")
    p.add_argument("-o", "--out", required=True, help="output .h5 file")
    p.add_argument("--key", help="dataset name for a single .npy input (default: its file stem)")
    p.add_argument("--label-column", help="CSV: header name or 0-based number of the label column (-> key 'y')")
    p.add_argument("--csv-dtype", default="float32", help="CSV: dtype of the feature columns (default float32)")
    p.add_argument("--compression", choices=["none", "gzip", "lzf"], default="none")
    p.add_argument("--compression-opts", type=int, help="gzip level 0-9")
    p.add_argument("--shuffle", action="store_true", help="HDF5 shuffle filter (helps compression)")
    p.add_argument("--fletcher32", action="store_true", help="per-chunk fletcher32 checksums")
    p.add_argument("--chunk-rows", type=int, help="samples per chunk (default: ~1 MiB chunks)")
    _add_quiet(p)
    p.set_defaults(data_func=run_pack)

    p = sub.add_parser("shard", help="split one HDF5 file into N balanced shards",
                       description="Split a file into N shards (sizes differ by at most one sample), keeping "
                                   "dtypes, chunks, filters and attributes. Under mpiexec rank r writes shards "
                                   "r, r+size, ...; --only writes a subset (e.g. one per SLURM array task).",
                       epilog="examples:\n  hpctrain data shard train.h5 --num-shards 8 --out shards/\n"
                              "  hpctrain data shard train.h5 --num-shards 64 --out shards/ --only $SLURM_ARRAY_TASK_ID",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN.h5")
    p.add_argument("-n", "--num-shards", type=int, required=True)
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--keys", help="comma-separated per-sample keys (default: the file's 'keys' attribute, else all)")
    p.add_argument("--only", metavar="I[,J,...]", help="write only these shard indices (0-based; ranges like 0-7 too)")
    p.add_argument("--stratify", metavar="KEY", help="give every shard the same class proportions of this "
                   "integer label key (per class, shard counts differ by at most one)")
    _add_quiet(p)
    p.set_defaults(data_func=run_shard)

    p = sub.add_parser("inspect", help="keys, shapes, dtypes, chunks, compression, sample counts",
                       epilog="example:\n  hpctrain data inspect shards/ --json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="files, directories or globs")
    p.add_argument("--keys", help="comma-separated per-sample keys (default: the 'keys' attribute, else the "
                   "numeric datasets sharing the leading axis; dimension scales are coordinates)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(data_func=run_inspect)

    p = sub.add_parser("verify", help="checksums, equal key lengths, NaN/Inf; exit 1 on problems",
                       epilog="example:\n  hpctrain data verify train.h5 shards/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="files, directories or globs")
    p.add_argument("--keys", help="comma-separated keys to check (default: the file's sample keys)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_quiet(p)
    p.set_defaults(data_func=run_verify)

    p = sub.add_parser("merge", help="merge shards back into one file (checked against the parent's checksums)",
                       epilog="example:\n  hpctrain data merge shards/ --out train.h5",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="SHARD", help="shard files, a directory or a glob")
    p.add_argument("-o", "--out", required=True, help="output .h5 file")
    p.add_argument("--keys", help="comma-separated per-sample keys (default: from the shards)")
    _add_quiet(p)
    p.set_defaults(data_func=run_merge)


def _keys(text: Optional[str]) -> Optional[List[str]]:
    return [k.strip() for k in text.split(",") if k.strip()] if text else None


def _roles(text: Optional[str]) -> Optional[dict]:
    """``--roles x=KEY,y=KEY`` as a mapping (checked by ``pack``)."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        role, sep, key = item.partition("=")
        out[role.strip()] = key.strip() if sep else ""
    return out


def run_pack(args: argparse.Namespace) -> int:
    from hpctrain.data.pack import pack

    r = pack(args.inputs, args.out, key=args.key, label_column=args.label_column, csv_dtype=args.csv_dtype,
             compression=args.compression, compression_opts=args.compression_opts, shuffle_filter=args.shuffle,
             fletcher32=args.fletcher32, chunk_rows=args.chunk_rows, quiet=args.quiet, keys=_keys(args.keys),
             x=args.x, y=args.y, role_keys=_roles(args.roles))
    print(f"wrote {r.path}: {r.num_samples} samples, keys {', '.join(r.keys)}, {r.nbytes / 2**20:.1f} MiB of data")
    return 0


def _world() -> tuple:
    """(rank, size): from MPI when started by a launcher, else (0, 1) without touching MPI."""
    from hpctrain.comm.launcher import detect_launcher

    if detect_launcher(os.environ) == "none":
        return 0, 1
    from hpctrain import comm

    comm.init()
    return comm.rank(), comm.size()


def parse_indices(text: str) -> list:
    """'3' → [3]; '0-3,7' → [0, 1, 2, 3, 7]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise SystemExit(f"hpctrain data shard: --only {text!r}: expected indices like 3 or 0-7,9")
        lo = int(match.group(1))
        out.extend(range(lo, int(match.group(2) or lo) + 1))
    return out


def run_shard(args: argparse.Namespace) -> int:
    from hpctrain.data.shard import shard

    rank, size = _world()
    written = shard(args.input, args.num_shards, args.out, keys=_keys(args.keys), rank=rank, size=size,
                    quiet=args.quiet or rank != 0, only=parse_indices(args.only) if args.only else None,
                    stratify=args.stratify)
    if size > 1:
        from hpctrain import comm

        total = sum(comm.allgather_object(len(written)))
        if rank == 0:
            print(f"wrote {total} shards of {args.input} to {args.out} ({size} ranks)")
    else:
        print(f"wrote {len(written)} shards of {args.input} to {args.out}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from hpctrain.data.h5files import expand_paths
    from hpctrain.data.verify import inspect_paths, render_inspect

    report = inspect_paths(expand_paths(args.paths), _keys(args.keys))
    print(json.dumps(report, indent=2, default=str) if args.json else render_inspect(report))
    return 1 if report["errors"] else 0


def run_verify(args: argparse.Namespace) -> int:
    from hpctrain.data.h5files import expand_paths
    from hpctrain.data.verify import render_verify, verify_paths

    report = verify_paths(expand_paths(args.paths), _keys(args.keys), quiet=args.quiet)
    print(json.dumps(report, indent=2, default=str) if args.json else render_verify(report))
    return 0 if report["ok"] else 1


def run_merge(args: argparse.Namespace) -> int:
    from hpctrain.data.h5files import expand_paths
    from hpctrain.data.shard import merge

    paths = expand_paths(args.paths)
    out = merge(paths, args.out, keys=_keys(args.keys), quiet=args.quiet)
    print(f"merged {len(paths)} shards into {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run one data verb; a DataError becomes one clear message and exit code 2."""
    from hpctrain.data.errors import DataError

    try:
        return args.data_func(args)
    except DataError as exc:
        print(f"hpctrain data {args.data_verb}: error: {exc}", file=sys.stderr)
        from hpctrain import comm

        if comm.is_initialized() and comm.size() > 1:
            sys.stderr.flush()
            comm.abort_job(2)  # the other ranks may wait in a collective: end them too
        return 2


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("data", help=help_text, description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="data_verb", metavar="VERB", required=True)
    add_verbs(verbs)
    p.set_defaults(func=run)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``data_tools/*.py`` and ``python -m hpctrain.cli.data``."""
    parser = argparse.ArgumentParser(prog="hpctrain data", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="data_verb", metavar="VERB", required=True)
    add_verbs(verbs)
    args = parser.parse_args(argv)
    from hpctrain.comm.abort import run_or_abort

    return run_or_abort(run, args)


if __name__ == "__main__":
    sys.exit(main())

"""``hpctrain plan``: predicted step time, samples/s and scaling efficiency per node count,
the best fusion threshold and all-reduce algorithm, from a profile (``hpctrain bench
calibrate``, or written by hand: docs/scaling.md). Pure arithmetic: no MPI, run it anywhere."""
from __future__ import annotations

import argparse
import json
import sys

EPILOG = """examples:
  hpctrain plan --profile profile.json --nodes 1,2,4,8,16,32,64 --ranks-per-node 4 --fabric ib-hdr
  hpctrain plan --profile profile.json --nodes 1,16,256 --ranks-per-node 8 --link '2us,12.5GB/s' --json -
  hpctrain plan --profile published:vgg16 --nodes 1,8,32,128 --ranks-per-node 4 --plot vgg16.png
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True,
                   help="profile JSON (from `hpctrain bench calibrate`), or published:MODEL (inception_v3, "
                        "resnet101, vgg16: one GPU of Horovod's published 512-GPU run)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256,512,1024", help="comma list of node counts")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks (GPUs) per node (default: as calibrated, else 1)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--fabric", default=None,
                      help="inter-node link by name: eth10, eth25, eth100, roce25, roce100, roce200, ib-edr, "
                           "ib-hdr, ib-ndr (replaces the profile's)")
    link.add_argument("--link", default=None, help="inter-node link as 'LATENCY,BANDWIDTH', e.g. '2us,12.5GB/s'")
    p.add_argument("--thresholds", default="1MiB,4MiB,16MiB,64MiB,256MiB",
                   help="fusion thresholds to try (the profile's own is always tried)")
    p.add_argument("--algorithms", default="ring,hierarchical,recursive_doubling,tree,rabenseifner,best",
                   help="algorithms to predict; best: the cheapest per bucket")
    p.add_argument("--straggler", type=float, default=0.0, metavar="FRACTION",
                   help="also predict each node count's best configuration with one rank this much slower "
                        "(0.1: 10%%)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every point as JSON ('-': stdout)")
    p.add_argument("--plot", default=None, metavar="PNG", help="efficiency and step time vs nodes (needs matplotlib)")
    p.set_defaults(func=run, no_mpi=True)


def _nodes(text: str):
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nodes {text!r}: expected a comma list of integers, e.g. 1,2,4,8") from None
    if not nodes or min(nodes) < 1:
        raise ValueError(f"--nodes {text!r}: every count must be >= 1")
    return sorted(set(nodes))


def _profile(spec: str):
    from hpctrain.scaling.profile import load_profile, profile_from_dict

    if spec.startswith("published:"):
        from hpctrain.scaling.published import HOROVOD_512

        name = spec.partition(":")[2]
        if name not in HOROVOD_512:
            raise ValueError(f"--profile {spec!r}: no such published profile; valid: "
                             + ", ".join(f"published:{n}" for n in HOROVOD_512))
        return profile_from_dict(HOROVOD_512[name])
    return load_profile(spec)


def run(args: argparse.Namespace) -> int:
    from hpctrain.scaling.fabrics import link_from_spec
    from hpctrain.scaling.predict import plan_scaling
    from hpctrain.scaling.report import format_table, write_plot
    from hpctrain.settings import parse_size

    try:
        profile = _profile(args.profile)
        inter = link_from_spec(args.fabric or args.link) if (args.fabric or args.link) else None
        per_node = args.ranks_per_node or int(profile.measured.get("ranks_per_node", 1))
        if per_node < 1:
            raise ValueError(f"--ranks-per-node {per_node}: must be >= 1")
        thresholds = [parse_size(t) for t in args.thresholds.split(",") if t.strip()]
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        result = plan_scaling(profile, _nodes(args.nodes), per_node, algorithms, thresholds, inter, args.straggler)
    except ValueError as exc:
        print(f"hpctrain plan: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(format_table(result), end="")
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {write_plot(result, args.plot)}")
    return 0

#!/usr/bin/env python3
"""Predicted vs measured step time across the local multi-node cluster, links shaped by tc.

Starts (or reuses) the namespace cluster of tests/cluster/ with three nodes, limits every
node's port to ``--rate`` with a token-bucket filter (tc tbf, both directions of each veth),
then:

1. ``hpctrain bench calibrate`` on 2 nodes x 1 rank: the profile (compute, gradients, and the
   shaped link's α and β by ping-pong) and a measured data-parallel step;
2. the same command on 1 node and on 3 nodes x 1 rank, for their measured steps;
3. ``hpctrain bench allreduce --algos ring`` of the gradients' size on 2 and 3 nodes;
4. ``hpctrain plan --profile <2-node profile> --nodes 1,2,3 --ranks-per-node 1 --json``, and per
   node count a plan from that run's own compute with the 2-node link (the namespace nodes
   share the machine's cores, so compute depends on how many run);

and prints predicted vs measured step and all-reduce time per node count. The all-reduce is pinned to
hpctrain's ring (HPCTRAIN_ALLREDUCE=ring) and the plan to the ``ring`` rows at the profile's
fusion threshold, so both sides run the same algorithm. The shaping is removed on every exit.

Needs root (network namespaces, tc) and Open MPI 5; run from the repository root:

  .venv/bin/python benchmarks/validate_scaling.py --rate 1gbit [--steps 30] [--json out.json]

A small tbf burst (64 KB at 1 Gbit/s) throttles a ring's two-way TCP flows far below the rate
a one-way ping-pong measures; the default burst is 1 MB.

Latency is not added: that needs tc's netem qdisc, which not every kernel has; the veth
link's own latency (tens of µs, measured by calibrate) is what the model gets.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import cluster  # noqa: E402  (tests/cluster: the namespace cluster and its mpiexec)

NODES = 3
HUB_NS = "/run/netns/hpct-hub"


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tc rate of every node's port, each direction (default 1gbit)")
    p.add_argument("--burst", default="1mb", help="tbf burst (default 1mb)")
    p.add_argument("--tbf-latency", default="50ms", help="tbf queue limit as latency (default 50ms)")
    p.add_argument("--features", type=int, default=256, help="MLP input width (default 256)")
    p.add_argument("--hidden", default="512,512", help="MLP hidden widths (default 512,512)")
    p.add_argument("--batch", type=int, default=64, help="batch per rank (default 64)")
    p.add_argument("--steps", type=int, default=10, help="calibrate --steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="calibrate --warmup (default 3)")
    p.add_argument("--overlap", choices=("auto", "0", "1"), default="auto",
                   help="HPCTRAIN_OVERLAP for the data-parallel steps (default auto: the optimizer decides)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per calibrate run (default 600)")
    p.add_argument("--workdir", default=None, help="keep config, profiles and plan here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the table and inputs as JSON here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- shaping
def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["nsenter", f"--net={netns}", "tc", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {netns} failed: {proc.stderr.strip()} "
                           "HINT: needs root and the kernel's sch_tbf")
    return proc


def shaped_ports(n: int) -> List[tuple]:
    """(namespace, device) of both ends of every node's veth: eth0 inside the node (what it
    sends) and veth<i> on the hub's bridge (what it receives)."""
    return [p for i in range(1, n + 1) for p in ((f"/run/netns/node{i}", "eth0"), (HUB_NS, f"veth{i}"))]


def shape(n: int, rate: str, burst: str, latency: str = "50ms") -> None:
    for ns, dev in shaped_ports(n):
        _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)


def unshape(n: int) -> List[str]:
    """Remove the root qdiscs; returns the ports that still show a tbf (empty when clean)."""
    left = []
    for ns, dev in shaped_ports(n):
        if not os.path.exists(ns):
            continue
        _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        if "tbf" in _tc(ns, "qdisc", "show", "dev", dev, check=False).stdout:
            left.append(f"{ns}:{dev}")
    return left


def shaping_state(n: int) -> Dict[str, str]:
    return {f"{ns}:{dev}": _tc(ns, "qdisc", "show", "dev", dev, check=False).stdout.strip()
            for ns, dev in shaped_ports(n)}


# ----------------------------------------------------------------------------- runs
def write_inputs(work: Path, args: argparse.Namespace) -> Path:
    import numpy as np

    from hpctrain.data.pack import pack

    rng = np.random.default_rng(0)
    np.savez(work / "train.npz", x=rng.random((512, args.features), dtype=np.float32), y=rng.integers(0, 4, 512))
    pack([str(work / "train.npz")], str(work / "train.h5"), quiet=True)
    hidden = [int(h) for h in args.hidden.split(",")]
    cfg = work / "mlp.yaml"
    cfg.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: {hidden}}}}}
data: {{train: ["{work / 'train.h5'}"]}}
optimizer: {{name: sgd, lr: 0.01}}
batch_size: {args.batch}
steps: 4
threads: 1
""")
    return cfg


def calibrate(nodes: int, cfg: Path, out: Path, args: argparse.Namespace) -> dict:
    argv = [str(Path(sys.executable).parent / "hpctrain"), "bench", "calibrate", str(cfg), "--out", str(out),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    hosts = ",".join(f"node{i}" for i in range(1, nodes + 1))
    env = {"HPCTRAIN_ALLREDUCE": "ring", **({} if args.overlap == "auto" else {"HPCTRAIN_OVERLAP": args.overlap})}
    proc = cluster.run_mpi_on_cluster(hosts, argv, timeout=args.timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"calibrate on {hosts} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    print(proc.stdout.strip().splitlines()[-2], flush=True)
    return json.loads(out.read_text())


def ring_allreduce_s(nodes: int, nbytes: int, args: argparse.Namespace) -> float:
    """The bare ring all-reduce of the gradients' bytes across ``nodes`` (bench allreduce's
    median time), to separate the network model from the rest of a data-parallel step."""
    argv = [str(Path(sys.executable).parent / "hpctrain"), "bench", "allreduce", "--sizes", str(nbytes),
            "--algos", "ring", "--iters", "10", "--warmup", "2"]
    hosts = ",".join(f"node{i}" for i in range(1, nodes + 1))
    proc = cluster.run_mpi_on_cluster(hosts, argv, timeout=args.timeout)
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[1:2] == ["ring"]]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"bench allreduce on {hosts} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return float(rows[-1][2]) * 1e-6


def plan(profile: Path, out: Path, nodes: str = "1,2,3") -> dict:
    hpctrain = str(Path(sys.executable).parent / "hpctrain")
    cmd = [hpctrain, "plan", "--profile", str(profile), "--nodes", nodes, "--ranks-per-node", "1",
           "--algorithms", "ring", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"hpctrain plan failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(out.read_text())


def compute_s(profile: dict) -> float:
    c = profile["compute"]
    return c.get("forward_s", 0.0) + c["backward_s"] + c.get("optimizer_s", 0.0)


def own_compute_plans(profiles: Dict[int, dict], work: Path) -> Dict[int, dict]:
    """Per node count, the plan from that run's own profile with the 2-node calibration's
    inter-node link: the namespace nodes share this machine's cores, so a rank's compute
    depends on how many nodes run, which no network model can know."""
    link = profiles[2]["links"]["inter"]
    out = {}
    for n, prof in profiles.items():
        path = work / f"profile-{n}-link2.json"
        path.write_text(json.dumps({**prof, "links": {**prof["links"], "inter": link}}))
        out[n] = plan(path, work / f"plan-{n}.json", str(n))["summary"][0]["at_profile_threshold"]
    return out


def table(profiles: Dict[int, dict], predicted: dict, own: Dict[int, dict]) -> List[dict]:
    rows = []
    for entry in predicted["summary"]:
        n = entry["nodes"]
        point = entry["at_profile_threshold"]
        measured = profiles[n]["measured"]["step_s"]
        rows.append({"nodes": n, "measured_step_s": measured, "predicted_step_s": point["step_s"],
                     "predicted_comm_s": point["comm_s"], "error": point["step_s"] / measured - 1,
                     "compute_s_this_run": compute_s(profiles[n]), "predicted_own_compute_s": own[n]["step_s"],
                     "error_own_compute": own[n]["step_s"] / measured - 1})
    return rows


def print_table(rows: List[dict], link: dict, cal: dict) -> None:
    print(f"\n2-node calibration: compute {compute_s(cal) * 1e3:.2f} ms/step, gradients "
          f"{sum(_numel(p['shape']) for p in cal['parameters']) * 4} bytes, threshold {cal['fusion_threshold']} B; "
          f"inter α {link['alpha_s'] * 1e6:.0f} µs, β {link['bandwidth_Bps'] / 1e6:.1f} MB/s")
    print("| nodes × ranks | measured step (ms) | predicted, 2-node profile (ms) | error "
          "| predicted all-reduce (ms) | compute in that run (ms) | predicted, that run's compute (ms) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} × 1 | {r['measured_step_s'] * 1e3:.1f} | {r['predicted_step_s'] * 1e3:.1f} "
              f"| {r['error'] * 100:+.1f}% | {r['predicted_comm_s'] * 1e3:.1f} | {r['compute_s_this_run'] * 1e3:.1f} "
              f"| {r['predicted_own_compute_s'] * 1e3:.1f} | {r['error_own_compute'] * 100:+.1f}% |")


def print_allreduce_table(rows: List[dict], bare: Dict[int, float]) -> None:
    print("\n| nodes × ranks | bare ring all-reduce of the gradients, measured (ms) | predicted (ms) | error |")
    print("|---|---|---|---|")
    for r in rows[1:]:
        r["measured_allreduce_s"] = bare[r["nodes"]]
        print(f"| {r['nodes']} × 1 | {bare[r['nodes']] * 1e3:.1f} | {r['predicted_comm_s'] * 1e3:.1f} "
              f"| {(r['predicted_comm_s'] / bare[r['nodes']] - 1) * 100:+.1f}% |")


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ----------------------------------------------------------------------------- main
def validate(args: argparse.Namespace, work: Path) -> dict:
    cfg = write_inputs(work, args)
    shape(NODES, args.rate, args.burst, args.tbf_latency)
    applied = shaping_state(NODES)
    missing = [port for port, text in applied.items() if "tbf" not in text]
    if missing:
        raise RuntimeError(f"tbf not on {missing} after shaping")
    load_before = loadavg()
    print(f"shaped {len(applied)} veth ends to {args.rate} (tbf); load average {load_before}", flush=True)
    profiles = {}
    for n in (2, 1, 3):
        profiles[n] = calibrate(n, cfg, work / f"profile-{n}.json", args)
    nbytes = sum(_numel(p["shape"]) for p in profiles[2]["parameters"]) * 4
    bare = {n: ring_allreduce_s(n, nbytes, args) for n in (2, 3)}
    predicted = plan(work / "profile-2.json", work / "plan.json")
    rows = table(profiles, predicted, own_compute_plans(profiles, work))
    cal = profiles[2]
    print_table(rows, cal["links"]["inter"], cal)
    print_allreduce_table(rows, bare)
    return {"overlap": args.overlap, "load_average_before": load_before, "loadavg_after": loadavg(),
            "rate": args.rate, "burst": args.burst, "tbf_latency": args.tbf_latency, "rows": rows,
            "shaping": applied, "inter": cal["links"]["inter"],
            "plan_command": "hpctrain plan --profile profile-2.json --nodes 1,2,3 --ranks-per-node 1 "
                            "--algorithms ring --json plan.json"}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    ok, why = cluster.cluster_available()
    if not ok:
        print(f"validate_scaling: the local cluster cannot run here: {why}", file=sys.stderr)
        return 2
    # Registered as the test fixture registers: a cluster this starts is stopped by its last user.
    cluster._acquire(NODES)
    # SIGTERM/SIGINT unwind through the finally below, so the shaping never outlives the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result, rc = None, 0
    try:
        with tempfile.TemporaryDirectory(prefix="hpct-validate-") as tmp:
            work = Path(args.workdir or tmp)
            work.mkdir(parents=True, exist_ok=True)
            result = validate(args, work)
    finally:
        left = unshape(NODES)
        if left:
            print(f"validate_scaling: tbf still on {left}; remove with tc qdisc del", file=sys.stderr)
            rc = 1
        else:
            print(f"shaping removed; load average {loadavg()}", flush=True)
        cluster._release()
    if result is not None and args.json:
        Path(args.json).write_text(json.dumps({**result, "shaping_removed": not left}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

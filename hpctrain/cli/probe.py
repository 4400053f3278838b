"""``hpctrain probe``: show the hardware each rank sees (GPUs, CPUs, memory, disks, MPI,
launcher, SLURM allocation, network), where each rank would run, and what looks wrong.
With ``--tune-batch MODULE:FACTORY`` it also finds the largest per-device batch that fits
on every rank and scales the learning rate to the resulting global batch.

FACTORY is called with no arguments and returns a ``hpctrain.probe.TuneTarget`` (see
docs/probe.md); MODULE is a dotted module name or a path to a .py file.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence

EPILOG = """examples:
  hpctrain probe
  mpiexec -n 2 hpctrain probe --json
  srun --mpi=pmix hpctrain probe --checkpoint-dir $SCRATCH/ckpt
  hpctrain probe --tune-batch examples/tune_mlp.py:factory --max-memory 512MiB
  hpctrain launch -n 2 -- hpctrain probe --tune-batch examples.tune_mlp:factory --max-memory 1GiB --json
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("probe", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output (rank 0 prints one JSON object)")
    p.add_argument("--work-dir", default=None, help="directory whose free space to report (default: current)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory whose free space to report (default: $HPCTRAIN_CHECKPOINT_DIR)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device for binding and tuning (default: a GPU when one is usable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks per node)")
    t = p.add_argument_group("batch-size tuning")
    t.add_argument("--tune-batch", metavar="MODULE:FACTORY", default=None,
                   help="tune the per-device batch for the model FACTORY() describes")
    t.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="memory budget per rank, e.g. 2GiB (default: GPU free memory, or available RAM / ranks per node)")
    t.add_argument("--margin", type=float, default=0.10, help="fraction of the budget kept free (default 0.10)")
    t.add_argument("--max-batch", type=int, default=1 << 16, help="largest per-device batch to try (default 65536)")
    t.add_argument("--accumulation-steps", type=int, default=None, help="gradient accumulation steps (default: target's)")
    t.add_argument("--lr-rule", choices=("linear", "sqrt", "none"), default=None,
                   help="learning-rate scaling rule (default: target's, normally linear)")
    t.add_argument("--base-lr", type=float, default=None, help="learning rate known to work at --base-batch")
    t.add_argument("--base-batch", type=int, default=None, help="global batch that --base-lr was tuned for")
    p.set_defaults(func=run)


def load_factory(spec: str) -> Any:
    """'pkg.module:name' or 'path/to/file.py:name' → the object named."""
    if ":" not in spec:
        raise SystemExit(f"hpctrain probe: --tune-batch wants MODULE:FACTORY, got {spec!r}.\n"
                         "HINT: e.g. --tune-batch examples/tune_mlp.py:factory")
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.exists():
                raise SystemExit(f"hpctrain probe: no such file {module_name!r} (from --tune-batch {spec!r})")
            mod_spec = importlib.util.spec_from_file_location(f"_hpctrain_tune_{path.stem}", path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"hpctrain probe: cannot import {module_name!r} for --tune-batch: {exc}\n"
                         "HINT: run from the directory that holds it, or give a path to the .py file") from exc
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise SystemExit(f"hpctrain probe: {module_name!r} has no {attr!r}; callables there: {', '.join(names)}")
    return getattr(module, attr)


def make_target(factory: Any, args: argparse.Namespace):
    """Call FACTORY() and apply command-line overrides."""
    import dataclasses

    from hpctrain.probe import TuneTarget

    try:
        target = factory()
    except TypeError as exc:
        raise SystemExit(f"hpctrain probe: calling {args.tune_batch}() failed: {exc}\n"
                         "HINT: FACTORY must be callable with no arguments and return a TuneTarget") from exc
    if isinstance(target, dict):
        target = TuneTarget(**target)
    if not isinstance(target, TuneTarget):
        raise SystemExit(f"hpctrain probe: {args.tune_batch} returned {type(target).__name__}, expected a "
                         "hpctrain.probe.TuneTarget.\nHINT: see docs/probe.md, 'The FACTORY protocol'")
    overrides = {k: v for k, v in (("base_lr", args.base_lr), ("base_batch", args.base_batch),
                                   ("lr_rule", args.lr_rule), ("accumulation_steps", args.accumulation_steps))
                 if v is not None}
    return dataclasses.replace(target, **overrides) if overrides else target


# --------------------------------------------------------------------------- text output
def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> List[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render_text(all_facts, plans, view) -> str:
    from hpctrain.probe import format_bytes

    lines: List[str] = []
    first = all_facts[0]
    lines.append(f"hpctrain probe: {view.world_size} rank(s) on {len(view.nodes)} node(s); "
                 f"MPI: {first.mpi.implementation or '?'} {first.mpi.version or ''}; launcher: {view.launcher}")
    s = first.slurm
    if s.in_job:
        lines.append(f"SLURM job {s.job_id}" + (f" step {s.step_id}" if s.step_id else "")
                     + f": nodes {s.nodelist} ({s.num_nodes}), tasks {s.ntasks}, tasks/node {s.tasks_per_node}, "
                     f"cpus/task {s.cpus_per_task or '-'}, gpus/task {s.gpus_per_task or '-'}")
    else:
        lines.append("SLURM: not in a job")
    by_host = {}
    for f in all_facts:
        by_host.setdefault(f.hostname, f)
    for node in view.nodes:
        f = by_host[node.hostname]
        lines.append("")
        lines.append(f"node {node.hostname}: {node.cpu_model or 'CPU ?'}, {node.cores_physical or '?'} cores / "
                     f"{node.cores_logical} threads, {node.numa_nodes} NUMA node(s); RAM "
                     f"{format_bytes(node.memory_available)} available of {format_bytes(node.memory_total)}"
                     + (f" (cgroup limit {format_bytes(f.memory.cgroup_limit)})" if f.memory.cgroup_limit else ""))
        if node.gpus:
            rows = [("GPU", "name", "memory free/total", "CC", "links")]
            for g in node.gpus:
                links = " ".join(f"{o}:{k}" for o, k in g.links) or "-"
                rows.append((str(g.index), g.name, f"{format_bytes(g.memory_free)}/{format_bytes(g.memory_total)}",
                             g.compute_capability or "?", links))
            lines.extend(_table(rows))
            lines.append(f"  driver {f.gpus.driver_version or '?'} (CUDA {f.gpus.cuda_driver_version or '?'}), "
                         f"torch CUDA {f.gpus.torch_cuda_version or 'none'}, source {f.gpus.source}, "
                         f"CUDA_VISIBLE_DEVICES={f.gpus.cuda_visible_devices!r}")
        else:
            lines.append(f"  no GPU ({'; '.join(f.gpus.notes) or 'none found'})")
        for d in f.disks:
            lines.append(f"  disk ({d.role}) {d.path}: {format_bytes(d.free)} free of {format_bytes(d.total)}"
                         + (f" [measured at {d.measured_at}]" if d.measured_at != d.path else "")
                         + (f" [{d.error}]" if d.error else ""))
        up = [i for i in f.network.interfaces if i.up and i.name != "lo"]
        lines.append("  network: " + (", ".join(f"{i.name} {','.join(a for a in i.addresses if ':' not in a) or '-'}"
                                                + (f" {i.speed_mbps} Mb/s" if i.speed_mbps else "") for i in up) or "none up"))
        for p in f.network.infiniband:
            lines.append(f"  RDMA {p.device} port {p.port}: {p.state or '?'}, {p.rate or '?'}, {p.link_layer or '?'}")
        for h in f.network.hints:
            lines.append(f"  hint: {h}")
        rows = [("rank", "local", "pid", "device", "threads")]
        for r in node.ranks:
            rows.append((str(r.rank), str(r.local_rank), str(r.pid), r.device + (f" (GPU {r.gpu})" if r.gpu is not None
                                                                                 and r.device != "cpu" else ""),
                         str(r.threads)))
        lines.extend(_table(rows))
    lines.append("")
    if view.warnings:
        lines.append("warnings:")
        for w in view.warnings:
            for i, part in enumerate(w.splitlines()):
                lines.append(("  - " if i == 0 else "    ") + part)
    else:
        lines.append("no warnings")
    return "\n".join(lines)


def _binding_dict(plan) -> dict:
    import dataclasses

    d = dataclasses.asdict(plan)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def run(args: argparse.Namespace) -> int:
    from hpctrain import comm
    from hpctrain.probe import build_cluster_view, collect_facts, gather_facts, parse_bytes, plan_binding

    max_memory: Optional[int] = None
    if args.max_memory is not None:
        try:
            max_memory = parse_bytes(args.max_memory)
        except ValueError as exc:
            raise SystemExit(f"hpctrain probe: --max-memory: {exc}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"hpctrain probe: --threads must be ≥ 1, got {args.threads}")
    if not 0.0 <= args.margin < 1.0:
        raise SystemExit(f"hpctrain probe: --margin must be in [0, 1), got {args.margin}")
    if args.max_batch < 1:
        raise SystemExit(f"hpctrain probe: --max-batch must be ≥ 1, got {args.max_batch}")
    target = make_target(load_factory(args.tune_batch), args) if args.tune_batch else None

    comm.init()
    facts = collect_facts(work_dir=args.work_dir, checkpoint_dir=args.checkpoint_dir)
    all_facts = gather_facts(facts)
    plans = [plan_binding(f, threads=args.threads, device=args.device) for f in all_facts]
    view = build_cluster_view(all_facts, plans)
    tune = None
    if target is not None:
        from hpctrain.probe import bind, tune_target

        bind(facts, threads=args.threads, device=args.device)
        tune = tune_target(target, max_memory=max_memory, margin=args.margin, max_batch=args.max_batch,
                           device=args.device, facts=facts)
    if comm.rank() == 0:
        if args.json:
            out = {
                "ranks": [dict(f.to_dict(), binding=_binding_dict(p)) for f, p in zip(all_facts, plans)],
                "cluster": view.to_dict(),
            }
            if tune is not None:
                out["tune"] = tune.to_dict()
            print(json.dumps(out, indent=1), flush=True)
        else:
            print(render_text(all_facts, plans, view), flush=True)
            if tune is not None:
                print("\nbatch-size tuning:\n" + "\n".join("  " + line for line in tune.explanation.splitlines()),
                      flush=True)
    comm.barrier()
    return 0

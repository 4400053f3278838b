"""``hpctrain train CONFIG.yaml``: train a model from a YAML config on every rank of the job.

Run it under your launcher: ``mpirun -n 4 hpctrain train run.yaml`` on a workstation,
``srun hpctrain train run.yaml`` inside an sbatch script. Override any key with
``--set key=value`` (dotted keys); ``--dry-run`` validates and prints the plan.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

EPILOG = """examples:
  hpctrain train examples/digits.yaml --dry-run
  hpctrain launch -n 2 -- hpctrain train examples/digits.yaml
  hpctrain launch -n 4 -- hpctrain train examples/digits_hybrid.yaml   # 2 replicas x 2 pipeline stages
  mpirun -n 4 hpctrain train run.yaml --set optimizer.lr=0.05 --set epochs=20 --quiet
  mpirun -n 4 hpctrain train run.yaml --resume auto        # continue from the newest valid checkpoint
  hpctrain report runs/digits
exit codes: 0 done (or preempted and requeued), 1 NaN/Inf loss, 2 bad config or checkpoint directory,
  128+N stopped by signal N without a requeue (rerun with --resume auto)
"""


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("train", help=help_text, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG.yaml", help="training config (see docs/train.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optimizer.lr=0.05 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="validate the config and print the plan; do not train")
    p.add_argument("--ranks", type=int, default=None,
                   help="with --dry-run outside mpiexec: plan for this many ranks (default: the current world)")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="'auto': newest valid checkpoint in the checkpoint dir (fresh start if none); or a file")
    p.add_argument("--quiet", action="store_true", help="no progress bar (batch jobs); same as --set quiet=true")
    p.set_defaults(func=run)


def _env_rank() -> int:
    """This process's rank from the launcher's environment (before MPI is initialized)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s hpctrain[%(process)d] rank " + str(rank) + " %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from hpctrain.train.checkpoint import CheckpointError
    from hpctrain.train.config import ConfigError, load_config
    from hpctrain.data.errors import DataError

    overrides = list(args.overrides) + (["quiet=true"] if args.quiet else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        if _env_rank() == 0:  # every rank reads the same file: say it once
            print(f"hpctrain train: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(cfg, args)

    from hpctrain import comm
    from hpctrain.train.trainer import Trainer

    comm.init()
    rank = comm.rank()
    _setup_logging(rank)
    try:
        result = Trainer(cfg, resume=args.resume).fit()
    except (ConfigError, CheckpointError, DataError) as exc:
        # Every rank raises the same error (the trainer agrees on it first): print once.
        if rank == 0:
            print(f"hpctrain train: {exc}", file=sys.stderr)
        return 2
    if rank != 0:
        return 0 if result.status in ("completed", "stopped") else (1 if result.status == "nan" else 0)
    if result.status == "nan":
        print(f"hpctrain train: {result.message}", file=sys.stderr)
        return 1
    lines = [f"run directory: {os.path.abspath(result.run_dir)}"]
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    if result.test_accuracy is not None:
        lines.append(f"test accuracy: {result.test_accuracy:.4f}")
    if result.final_loss is not None:
        lines.append(f"final training loss: {result.final_loss:.4f}")
    lines.append(f"status: {result.status} at step {result.step} after {result.wall_s:.1f} s")
    if result.message:
        lines.append(result.message)
    print("\n".join(lines), flush=True)
    if result.status == "preempted" and not result.requeued:
        return 128 + (result.signal or 15)
    return 0


def _dry_run(cfg, args: argparse.Namespace) -> int:
    from hpctrain.data.errors import DataError
    from hpctrain.train.config import ConfigError
    from hpctrain.train.trainer import Trainer

    world = args.ranks
    rank = 0
    if world is None:
        from hpctrain.comm.launcher import detect_launcher

        if detect_launcher(os.environ) == "none":
            world = 1
        else:
            from hpctrain import comm

            comm.init()
            world, rank = comm.size(), comm.rank()
    try:
        plan = Trainer(cfg, resume=args.resume).make_plan(world)
        from hpctrain.train.callbacks import load_callbacks

        load_callbacks(cfg.callbacks)
        _check_model_and_deps(cfg, world)
    except (ConfigError, DataError) as exc:
        if rank == 0:
            print(f"hpctrain train --dry-run: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(f"config {args.config}: valid")
        if cfg.parallel and int(cfg.parallel.get("pipeline_stages", 1)) > 1:
            from hpctrain.parallel import bubble_fraction
            from hpctrain.train.pipeline import parallel_config

            pc = parallel_config(cfg)
            print(f"pipeline: {world} ranks = {plan.world_size} data-parallel replica(s) x {pc.pipeline_stages} stages "
                  f"({pc.schedule}, {pc.micro_batches} micro-batches per batch, bubble "
                  f"{bubble_fraction(pc.pipeline_stages, pc.micro_batches):.2f}); the data is shared among the "
                  "replicas ('rank' below = replica)")
        print(plan.describe())
        every = f"every {cfg.checkpoint.interval_steps} steps" if cfg.checkpoint.interval_steps else "every epoch"
        print(f"run directory: {cfg.run_dir}   checkpoints: {cfg.checkpoint_dir} (keep {cfg.checkpoint.keep}, {every})")
        print("dry run: nothing trained")
    return 0


def _check_model_and_deps(cfg, world: int) -> None:
    """What a run would meet before its first step: the factory imports and accepts its
    kwargs, the model takes the data (and its labels), and every optional package the
    config needs imports. Builds the model once; no communication."""
    from hpctrain.train import checks
    from hpctrain.train.trainer import import_factory

    from hpctrain.train.build import infer_model_kwargs, import_user_functions

    import_user_functions(cfg)
    factory = import_factory(cfg.model.factory)
    model = checks.build_model(factory, cfg.model.factory, infer_model_kwargs(cfg))
    if cfg.parallel and int(cfg.parallel.get("pipeline_stages", 1)) > 1:
        # a pipeline needs a model it can split
        from hpctrain.train.pipeline import check_model, parallel_config

        check_model(parallel_config(cfg), model, world, cfg.model.factory)
    else:
        checks.check_data_fits_model(cfg, model, factory)
    checks.check_optional_packages(cfg)

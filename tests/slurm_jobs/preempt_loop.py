"""Job payload for the preemption test: a deterministic multi-rank loop that checkpoints
and requeues itself on SIGUSR1/SIGTERM (hpctrain.slurm.preempt) and resumes on the rerun.

    python preempt_loop.py --dir RUN --steps 40 [--step-seconds 0.2]

RUN/ckpt.npz holds the state (written atomically by rank 0); RUN/result.npy the final state;
RUN/progress.log one line per step ("restart R step S") for the test to follow.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from hpctrain import comm
from hpctrain.slurm import env as slurm_env
from hpctrain.slurm import preempt


def step_fn(x: np.ndarray, step: int, rank: int) -> np.ndarray:
    local = np.sin(x * (rank + 1) + step)
    total = comm.allreduce(local)  # same value on every rank
    return 0.9 * x + 0.1 * total / comm.size()


def save(path: Path, step: int, x: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, step=step, x=x)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the old or the new checkpoint, never half


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-seconds", type=float, default=0.2)
    args = p.parse_args()
    run = Path(args.dir)
    ckpt, log = run / "ckpt.npz", run / "progress.log"

    guard = preempt.install()
    comm.init()
    rank = comm.rank()
    restart = slurm_env.restart_count()
    start, x = 0, np.linspace(0.0, 1.0, 16)
    if ckpt.exists():
        with np.load(ckpt) as z:
            start, x = int(z["step"]), z["x"].copy()
        if rank == 0:
            print(f"resumed from step {start} (SLURM_RESTART_COUNT={restart})", flush=True)
    agree = preempt.any_rank()
    for step in range(start, args.steps):
        x = step_fn(x, step, rank)
        if rank == 0:
            with open(log, "a") as f:
                f.write(f"restart {restart} step {step}\n")
        time.sleep(args.step_seconds)
        if guard.should_stop(agree=agree):
            if rank == 0:
                save(ckpt, step + 1, x)
                print(f"signal {guard.received.name if guard.received else 'on another rank'}: "
                      f"checkpoint at step {step + 1}; requeueing", flush=True)
            comm.barrier()  # nobody is killed by the requeue before the checkpoint is safe
            if rank == 0 and not guard.requeue():
                return 3
            return 0
    if rank == 0:
        np.save(run / "result.npy", x)
        print(f"finished {args.steps} steps (restart {restart})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

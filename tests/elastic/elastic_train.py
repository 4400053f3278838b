"""A Horovod elastic training script (only the import differs), run by tests/test_elastic.py
under a fault-tolerant mpiexec. It kills ranks of its own on purpose (``--kill``), at a chosen
step and place, and writes what the test compares: every rank's final weights, and the state
the survivors resumed from after each loss (for a reference run started from it, ``--resume``).

The data of step s is a fixed global batch of 24 samples (seeded by s), split over the ranks
by rank: a run on the same number of ranks from the same state computes the same weights.
"""
import argparse
import os
import signal
import time

import torch

import hpctrain.comm
import hpctrain.torch as hvd

GLOBAL_BATCH = 24

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--commit-every", type=int, default=3)
parser.add_argument("--kill", default="", help="LAUNCHED_RANK:STEP[,...]: SIGKILL that rank at that step")
parser.add_argument("--where", default="optimizer",
                    choices=("optimizer", "allreduce", "grouped", "shm", "checkpoint", "sync", "stall"))
parser.add_argument("--out", required=True)
parser.add_argument("--resume", default=None, help="a state file written at a reset: start from it")
parser.add_argument("--width", type=int, default=32, help="hidden layer width (benchmarks use a bigger model)")
parser.add_argument("--replay", action="store_true",
                    help="after finishing, run again from the state resumed at the last reset, without kills, on "
                         "the same ranks, and write replay-LAUNCHED.pt (the test compares it with final-LAUNCHED.pt)")
args = parser.parse_args()

LAUNCHED = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("SLURM_PROCID") or 0)
KILLS = {int(r): int(s) for r, s in (k.split(":") for k in args.kill.split(",") if k)}

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 4))
base_opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(base_opt, named_parameters=model.named_parameters())
if args.resume:
    saved = torch.load(args.resume, weights_only=False)
    model.load_state_dict(saved["model"])
    base_opt.load_state_dict(saved["optimizer"])
    start_step = saved["step"]
else:
    start_step = 0


def die_here(where: str, step: int) -> None:
    if args.where == where and KILLS.get(LAUNCHED) == step:
        with open(os.path.join(args.out, f"killed-{LAUNCHED}.txt"), "w") as f:
            f.write(f"{time.time()} {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]


def on_reset():
    for group in base_opt.param_groups:  # the learning rate follows the number of ranks
        group["lr"] = 0.05 * hvd.size()
    if hvd.rank() == 0:  # the state every survivor syncs to (rank 0's restored commit)
        n = len(hpctrain.comm.reforms())
        torch.save({"model": state.model.state_dict(), "optimizer": base_opt.state_dict(), "step": state.step,
                    "size": hvd.size()}, os.path.join(args.out, f"resumed-{n}.pt"))


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=start_step)
state.register_reset_callbacks([on_reset])


def save_checkpoint(step: int) -> None:
    """Rank 0 writes a checkpoint at every commit, atomically (temporary file, then rename)."""
    if hvd.rank() != 0:
        return
    path = os.path.join(args.out, "checkpoint.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "step": step}, f)
        f.flush()
        die_here("checkpoint", step)  # killed mid-write: the last complete checkpoint stays
    os.replace(path + ".tmp", path)


def stall_with_a_survivor(step: int) -> None:
    """Launched rank 1 is busy (8 s, outside MPI) while launched rank 0 waits for a message
    from it and the victim dies: rank 0's wait involves no dead process, so only its stall
    watchdog (HPCTRAIN_STALL_TIMEOUT) can tell that the job lost a rank."""
    die_here("stall", step)
    if LAUNCHED == 1:
        time.sleep(8)
        hpctrain.comm.send_object(step, dest=0)
    elif LAUNCHED == 0:
        hpctrain.comm.recv_object(source=1)


step_times = []  # (wall time at the end of a step, the step, ranks)


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        step = state.step
        x, y = batch(step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        die_here("optimizer", step)
        optimizer.step()
        die_here("allreduce", step)
        hvd.allreduce(loss.detach(), name="loss")
        die_here("grouped", step)
        hvd.grouped_allreduce([p.detach().sum().reshape(1) for p in model.parameters()], name="sums")
        die_here("shm", step)
        if args.where == "stall" and step in KILLS.values() and hpctrain.comm.generation() == 0:
            stall_with_a_survivor(step)
        hvd.allreduce(torch.ones(262144) * hvd.rank(), name="big", op=hvd.Sum)  # 1 MiB: the piped shm path
        state.step = step + 1
        step_times.append((time.time(), step, hvd.size()))
        if state.step % args.commit_every == 0:
            state.commit()
            save_checkpoint(state.step)
            die_here("sync", state.step)


def replay() -> torch.Tensor:
    """The reference: the remaining steps again from the state the survivors resumed from (rank 0's
    restored commit, read by every rank), plain (not under elastic.run), on the survivors."""
    n = len(hpctrain.comm.reforms())
    saved = torch.load(os.path.join(args.out, f"resumed-{n}.pt"), weights_only=False)
    model.load_state_dict(saved["model"])
    base_opt.load_state_dict(saved["optimizer"])
    for group in base_opt.param_groups:
        group["lr"] = 0.05 * hvd.size()
    args.where = "none"  # no kills
    state.step = saved["step"]
    train.__wrapped__(state)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


train(state)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
if args.replay and hpctrain.comm.reforms():
    torch.save({"weights": replay()}, os.path.join(args.out, f"replay-{LAUNCHED}.pt"))
torch.save({"weights": weights, "size": hvd.size(), "rank": hvd.rank(), "step": state.step,
            "step_times": torch.tensor(step_times, dtype=torch.float64)},
           os.path.join(args.out, f"final-{LAUNCHED}.pt"))
print(f"rank {hvd.rank()}/{hvd.size()} (launched {LAUNCHED}) finished at step {state.step}", flush=True)

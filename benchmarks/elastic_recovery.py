"""Elastic mode's costs, measured with the test suite's elastic training script
(tests/elastic/elastic_train.py, a Horovod elastic script):

- recovery: ``hpctrain launch --elastic -n RANKS``, launched rank RANKS-1 SIGKILLed in the
  middle of the run; the time from the kill to the first step the survivors start after
  re-forming (median over ``--runs``), and the step time (samples/s) before and after;
- overhead: the same script without a kill (``--overhead-ranks``), elastic (``--elastic``: Open MPI's
  ``--with-ft ulfm`` and HPCTRAIN_ELASTIC=1) against a plain launch, runs alternated, median
  step time of each.

    python benchmarks/elastic_recovery.py --runs 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "elastic" / "elastic_train.py"
GLOBAL_BATCH = 24  # the script's
WARMUP = 5  # steps left out of the step-time medians


def launch(out: Path, ranks: int, steps: int, width: int, elastic: bool, kill: str = "") -> None:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hpctrain.cli.main", "launch", "-n", str(ranks)]
    cmd += ["--elastic"] if elastic else []
    cmd += ["--", sys.executable, str(SCRIPT), "--steps", str(steps), "--width", str(width), "--commit-every", "5",
            "--out", str(out)] + (["--kill", kill] if kill else [])
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", OMP_NUM_THREADS="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def rank0_times(out: Path) -> torch.Tensor:
    """(end time, step, ranks) of every step, as the final rank 0 recorded them."""
    finals = [torch.load(p, weights_only=True) for p in out.glob("final-*.pt")]
    return next(f for f in finals if f["rank"] == 0)["step_times"]


def step_seconds(times: torch.Tensor) -> list:
    ends = times[:, 0].tolist()
    return [b - a for a, b in zip(ends, ends[1:])]


def recovery(out: Path) -> dict:
    killed_at = float(next(out.glob("killed-*.txt")).read_text().split()[0])
    times = rank0_times(out)
    before = times[times[:, 0] < killed_at]
    after = times[times[:, 0] > killed_at]
    after_steps = step_seconds(after)
    step_after = statistics.median(after_steps)
    return dict(resume_s=float(after[0, 0]) - killed_at - step_after,
                before_s=statistics.median(step_seconds(before)[WARMUP:]), after_s=step_after)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--overhead-ranks", type=int, default=2,
                   help="ranks of the no-failure runs (default 2: one per core on a 2-core machine)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rec = []
        for i in range(args.runs):
            out = Path(tmp) / f"kill{i}"
            launch(out, args.ranks, args.steps, args.width, True, kill=f"{args.ranks - 1}:{args.steps // 2}")
            rec.append(recovery(out))
            print(f"run {i}: resumed {rec[-1]['resume_s']:.3f} s after the kill; step {rec[-1]['before_s'] * 1e3:.2f} ms "
                  f"on {args.ranks} ranks, {rec[-1]['after_s'] * 1e3:.2f} ms on {args.ranks - 1}", flush=True)
        on, off = [], []
        for i in range(args.runs):
            for elastic, sink in ((True, on), (False, off)):
                out = Path(tmp) / f"{'on' if elastic else 'off'}{i}"
                launch(out, args.overhead_ranks, args.steps, args.width, elastic)
                sink.append(statistics.median(step_seconds(rank0_times(out))[WARMUP:]))
    med = {k: statistics.median(r[k] for r in rec) for k in rec[0]}
    print(f"\nkill -> training resumed: median {med['resume_s']:.3f} s over {args.runs} runs "
          f"(min {min(r['resume_s'] for r in rec):.3f}, max {max(r['resume_s'] for r in rec):.3f})")
    print(f"throughput: {GLOBAL_BATCH / med['before_s']:.0f} samples/s on {args.ranks} ranks before, "
          f"{GLOBAL_BATCH / med['after_s']:.0f} after on {args.ranks - 1}")
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"no failure, {args.overhead_ranks} ranks: step {m_on * 1e3:.2f} ms elastic vs {m_off * 1e3:.2f} ms plain (median of {args.runs} runs "
          f"each, alternated): overhead {100 * (m_on / m_off - 1):+.1f}%; per-run medians elastic "
          f"{', '.join(f'{x * 1e3:.2f}' for x in on)}, plain {', '.join(f'{x * 1e3:.2f}' for x in off)}")


if __name__ == "__main__":
    main()

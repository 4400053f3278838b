"""The fault and bad-input matrix: run hpctrain as a user would, break it, count what happens.

    python benchmarks/fault_matrix.py                 # every row, 2 ranks
    python benchmarks/fault_matrix.py --repeats 5     # random kills repeated 5 times each
    python benchmarks/fault_matrix.py --only kill     # rows whose name contains "kill"
    python benchmarks/fault_matrix.py --markdown out.md

Each row starts real commands (``hpctrain launch``, ``hpctrain train``, ``hpctrain data``,
``python -c``) in a scratch folder and classifies the outcome:

- ended: the command finished before its time limit (a hang is a failure, whatever else);
- clear: a bad input ended non-zero with a line carrying a HINT and no Python traceback;
- lost: checkpoint files that loaded before the fault and are gone (or no longer load) after
  it, other than those the keep-N rule replaces;
- payload: a pickled ``__reduce__`` payload planted in a file ran (a marker file appears).

The summary line gives the counts that docs/reliability.md reports.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent.parent
HPCTRAIN = [sys.executable, "-m", "hpctrain.cli.main"]


@dataclass
class Outcome:
    ended: bool
    rc: int
    seconds: float
    output: str
    clear: bool = False
    lost: int = 0
    payload: bool = False
    ok: bool = False
    detail: str = ""


@dataclass
class Row:
    name: str
    kind: str            # "fault", "bad input", "payload"
    expect: str          # what a user should see
    test: str            # the test that proves it
    run: Callable[["Ctx"], Outcome]


@dataclass
class Ctx:
    base: Path
    ranks: int
    data: Path = field(init=False)

    def __post_init__(self) -> None:
        self.data = self.base / "data"


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    e = dict(os.environ)
    if os.geteuid() == 0:
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("HPCTRAIN_STALL_TIMEOUT", "20")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = str(HERE) + os.pathsep + e.get("PYTHONPATH", "")
    if extra:
        e.update(extra)
    return e


def start(argv: List[str], cwd: Path, extra_env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=str(cwd), env=env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, t0: float, timeout: float) -> Outcome:
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        return Outcome(True, proc.returncode, time.monotonic() - t0, out or "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Outcome(False, -9, time.monotonic() - t0, (out or "") + f"\n[hung: killed after {timeout:.0f} s]")


def run(argv: List[str], cwd: Path, timeout: float = 180, extra_env: Optional[Dict[str, str]] = None) -> Outcome:
    t0 = time.monotonic()
    return finish(start(argv, cwd, extra_env), t0, timeout)


def launch(ctx: Ctx, argv: List[str]) -> List[str]:
    return [*HPCTRAIN, "launch", "-n", str(ctx.ranks), "--", *argv]


def is_clear(out: Outcome) -> bool:
    """Non-zero, a HINT, no traceback: what a user can act on without reading our code."""
    return out.ended and out.rc != 0 and "Traceback" not in out.output and "HINT" in out.output


# ---- data and configs --------------------------------------------------------------------

def make_data(ctx: Ctx) -> None:
    from sklearn.datasets import load_digits

    from hpctrain.data.pack import pack

    d = ctx.data
    d.mkdir(parents=True)
    digits = load_digits()
    x, y = digits.data.astype(np.float32), digits.target.astype(np.int64)
    arrays = {
        "train": (x[:900], y[:900]), "test": (x[900:1200], y[900:1200]),
        "labels_out_of_range": (x[:200], y[:200] + 5),
        "float_labels": (x[:200], y[:200].astype(np.float32) + 0.5),
        "narrow": (x[:200, :32], y[:200]),
        "tiny": (x[:3], y[:3]),
    }
    for name, (xs, ys) in arrays.items():
        np.savez(d / f"{name}.npz", x=xs, y=ys)
        pack([str(d / f"{name}.npz")], str(d / f"{name}.h5"), quiet=True)
    (d / "not_hdf5.h5").write_text("this is a CSV file, not HDF5\n1,2,3\n")
    raw = (d / "train.h5").read_bytes()
    (d / "truncated.h5").write_bytes(raw[: len(raw) // 3])


def config(ctx: Ctx, name: str, *, train: str = "train.h5", extra: str = "", model: str = "",
           data_extra: str = "", steps: int = 40, run_dir: Optional[Path] = None) -> Path:
    run_dir = run_dir or ctx.base / "runs" / name.replace(" ", "-")
    model = model or 'model: {factory: "hpctrain.train.models:mlp", kwargs: {hidden: [32], input_scale: 0.0625}}'
    path = ctx.base / "configs" / (re.sub(r"[^\w.-]+", "-", name) + ".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""{model}
data: {{train: ["{ctx.data / train}"], test: ["{ctx.data / 'test.h5'}"]{data_extra}}}
optimizer: {{name: adam, lr: 0.003}}
batch_size: 16
steps: {steps}
run_dir: "{run_dir}"
quiet: true
threads: 1
{extra}
""")
    return path


def valid_checkpoints(directory: Path) -> Dict[str, int]:
    """{file name: step} of the checkpoints in ``directory`` that load."""
    from hpctrain.train import checkpoint as ckpt

    found = {}
    if not directory.is_dir():
        return found
    for step, path in ckpt.list_checkpoints(directory):
        try:
            ckpt.load_checkpoint(path)
        except Exception:  # noqa: BLE001 - a file that does not load is what we count
            continue
        found[path.name] = step
    return found


# ---- rows: bad inputs --------------------------------------------------------------------

def bad_train(name: str, expect: str, test: str, *, dry_run: bool = False, env_extra: Optional[Dict[str, str]] = None,
              **config_kw) -> Row:
    def go(ctx: Ctx) -> Outcome:
        cfg = config(ctx, name, **config_kw)
        argv = [*HPCTRAIN, "train", str(cfg), "--dry-run"] if dry_run else launch(ctx, [*HPCTRAIN, "train", str(cfg)])
        out = run(argv, ctx.base, timeout=150, extra_env=env_extra)
        out.clear = is_clear(out)
        out.ok = out.clear
        return out
    return Row(name, "bad input", expect, test, go)


def bad_command(name: str, argv_of: Callable[[Ctx], List[str]], expect: str, test: str,
                env_extra: Optional[Dict[str, str]] = None,
                judge: Optional[Callable[[Outcome], bool]] = None) -> Row:
    """A command that must fail clearly (``judge``: another test of 'clear', e.g. for an
    error raised into the user's own script, where a traceback is the script's)."""
    def go(ctx: Ctx) -> Outcome:
        out = run(argv_of(ctx), ctx.base, timeout=120, extra_env=env_extra)
        out.clear = judge(out) if judge else is_clear(out)
        out.ok = out.clear
        return out
    return Row(name, "bad input", expect, test, go)


def names_both_shapes(out: Outcome) -> bool:
    return out.ended and out.rc != 0 and "(10, 100)" in out.output and "(100, 10)" in out.output


SHAPE_MISMATCH = """
from hpctrain import comm
import numpy as np
comm.init()
shape = (10, 100) if comm.rank() == 0 else (100, 10)
comm.allreduce(np.ones(shape, np.float32))
print("rank", comm.rank(), "no error", flush=True)
"""


def bad_input_rows() -> List[Row]:
    def mlp(kwargs: str) -> str:
        return f'model: {{factory: "hpctrain.train.models:mlp", kwargs: {kwargs}}}'

    def env_row(var: str, value: str) -> Row:
        return bad_train(f"env {var}={value}", expect=f"{var}={value!r} named with the accepted form",
                         test="tests/unit/test_settings.py", env_extra={var: value}, steps=10)

    return [
        bad_train("labels outside the classes", train="labels_out_of_range.h5",
                  model=mlp("{hidden: [32], num_classes: 10}"),
                  expect="labels 5..14 outside 0..9", test="tests/unit/test_train_checks.py"),
        bad_train("float labels for cross_entropy", train="float_labels.h5",
                  expect="labels must be integers", test="tests/unit/test_train_checks.py"),
        bad_train("feature width != model", train="narrow.h5", model=mlp("{in_features: 64, hidden: [32]}"),
                  expect="data has 32 features, model expects 64", test="tests/unit/test_train_checks.py"),
        bad_train("bad model.kwargs", model=mlp("{hiddn: [32]}"),
                  expect="unexpected keyword, accepted parameters listed", test="tests/unit/test_train_checks.py"),
        bad_train("misspelled model.factory (dry-run)", dry_run=True, model='model: {factory: "hpctrain.train.models:mpl"}',
                  expect="factory not found at dry-run", test="tests/test_train_cli.py"),
        bad_train("missing model file (dry-run)", dry_run=True, model='model: {factory: "nowhere/model.py:net"}',
                  expect="file not found at dry-run", test="tests/test_train_cli.py"),
        bad_train("unknown config key", extra="optimiser: {name: sgd}", expect="unknown key named, valid keys listed",
                  test="tests/unit/test_train_config.py"),
        bad_train("policy weighted, weights of the wrong length", data_extra=", policy: weighted, weights: [1, 2, 3]",
                  expect="one weight per rank", test="tests/test_train_cli.py"),
        bad_train("not an HDF5 file", train="not_hdf5.h5", expect="not HDF5", test="tests/unit/test_data_errors.py"),
        bad_train("truncated HDF5 file", train="truncated.h5", expect="damaged file named",
                  test="tests/unit/test_data_errors.py"),
        bad_train("dataset too small for the ranks", train="tiny.h5", expect="3 samples for 2 ranks",
                  test="tests/unit/test_data_planner.py"),
        bad_command("resume of a missing checkpoint", lambda ctx: launch(ctx, [
            *HPCTRAIN, "train", str(config(ctx, "resume-missing")), "--resume", str(ctx.base / "nope.pt")]),
            "checkpoint file not found", "tests/test_train_cli.py"),
        bad_command("shape mismatch (10,100) vs (100,10)", lambda ctx: launch(ctx, [sys.executable, "-c", SHAPE_MISMATCH]),
                    "error on every rank naming both shapes", "tests/mpi/test_comm_shapes_nan.py",
                    judge=names_both_shapes),
        env_row("HPCTRAIN_STALL_TIMEOUT", "abc"),
        env_row("HPCTRAIN_STALL_TIMEOUT", "-5"),
        env_row("HPCTRAIN_RING_SEGMENT_BYTES", "0"),
        env_row("HPCTRAIN_BACKEND", "bogus"),
        env_row("HPCTRAIN_SHM_SLOT_BYTES", "0"),
    ]


# ---- rows: faults ------------------------------------------------------------------------

def rank_pids(proc: subprocess.Popen, cfg: Path) -> List[int]:
    import psutil

    pids = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if str(cfg) in cmd and " train " in cmd and " launch " not in cmd and "mpiexec" not in cmd \
                and "prte" not in cmd:
            pids.append(child.pid)
    return sorted(pids)


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def newest_step(found: Dict[str, int]) -> int:
    return max(found.values(), default=-1)


def resume_completes(ctx: Ctx, cfg: Path, steps: int) -> Outcome:
    out = run(launch(ctx, [*HPCTRAIN, "train", str(cfg), "--resume", "auto"]), ctx.base, timeout=240)
    out.ok = out.ended and out.rc == 0 and f"status: completed at step {steps}" in out.output
    return out


def fault_row(name: str, expect: str, test: str, strike: Callable[[subprocess.Popen, List[int]], None],
              judge: Callable[[Outcome], bool], extra_env: Optional[Dict[str, str]] = None) -> Row:
    """Start a 2-rank run that checkpoints every 5 steps, strike once a checkpoint exists plus a
    random delay, then check the end, the checkpoints and a resume to the last step. A run
    that ended before the strike fails the row: it tested nothing."""
    steps = 2000  # several seconds on 2 cores: still running when the strike comes

    def go(ctx: Ctx) -> Outcome:
        tag = f"{name}-{random.randrange(1 << 30)}"
        run_dir = ctx.base / "runs" / re.sub(r"[^\w.-]+", "-", tag)
        cfg = config(ctx, tag, steps=steps, run_dir=run_dir, extra="checkpoint: {interval_steps: 5, keep: 2}")
        ckpts = run_dir / "checkpoints"
        t0 = time.monotonic()
        proc = start(launch(ctx, [*HPCTRAIN, "train", str(cfg)]), ctx.base, extra_env)
        if not wait_for(lambda: bool(valid_checkpoints(ckpts)), 120):
            out = finish(proc, t0, 1)
            out.detail = "no checkpoint appeared"
            return out
        time.sleep(random.uniform(0.0, 2.0))
        before = valid_checkpoints(ckpts)
        pids = rank_pids(proc, cfg)
        if proc.poll() is not None or not pids or newest_step(before) >= steps:
            out = finish(proc, t0, 1)
            out.ok, out.detail = False, f"the run ended before the strike (step {newest_step(before)} of {steps})"
            return out
        strike(proc, pids)
        struck = time.monotonic()
        out = finish(proc, t0, (struck - t0) + 90)
        out.seconds = time.monotonic() - struck
        after = valid_checkpoints(ckpts)
        out.lost = int(newest_step(after) < newest_step(before))
        resumed = resume_completes(ctx, cfg, steps)
        out.ok = out.ended and judge(out) and not out.lost and resumed.ok
        out.detail = f"ended in {out.seconds:.1f} s, rc {out.rc}; newest valid before {newest_step(before)}, " \
                     f"after {newest_step(after)}; resume {'completed' if resumed.ok else 'FAILED rc %d' % resumed.rc}"
        if not resumed.ok:
            out.output += "\n--- resume ---\n" + resumed.output
        return out
    return Row(name, "fault", expect, test, go)


def kill_rank(sig: int, which: str = "random") -> Callable[[subprocess.Popen, List[int]], None]:
    def strike(proc: subprocess.Popen, pids: List[int]) -> None:
        if pids:
            os.kill(random.choice(pids) if which == "random" else pids[-1], sig)
    return strike


def kill_launcher(sig: int) -> Callable[[subprocess.Popen, List[int]], None]:
    def strike(proc: subprocess.Popen, pids: List[int]) -> None:
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)   # the whole job at once, as a node failure or scancel -9
        else:
            proc.send_signal(sig)
    return strike


def stopped_message(out: Outcome) -> bool:
    return out.rc == 143 and "rerun with --resume auto" in out.output


def fault_rows() -> List[Row]:
    return [
        fault_row("kill -9 of a rank", "job ends non-zero, the rank named; resume continues",
                  "tests/test_train_cli.py", kill_rank(signal.SIGKILL), lambda o: o.rc != 0),
        fault_row("kill -9 of the whole job", "resume from the newest valid checkpoint",
                  "tests/test_train_cli.py", kill_launcher(signal.SIGKILL), lambda o: True),
        fault_row("SIGTERM to a rank", "stop checkpoint, exit 143, 'rerun with --resume auto'",
                  "tests/test_train_cli.py", kill_rank(signal.SIGTERM), stopped_message),
        fault_row("SIGTERM to the launcher", "stop checkpoint, exit 143, 'rerun with --resume auto'",
                  "tests/test_train_cli.py", kill_launcher(signal.SIGTERM), stopped_message),
        fault_row("a rank stalls (SIGSTOP)", "watchdog names the rank and aborts",
                  "tests/test_comm_faults.py", kill_rank(signal.SIGSTOP, "last"),
                  lambda o: o.rc != 0 and "STALL" in o.output, extra_env={"HPCTRAIN_STALL_TIMEOUT": "5"}),
        Row("a rank raises", "fault", "job ends non-zero naming the rank and the error",
            "tests/test_train_cli.py", rank_raises),
        Row("truncated newest checkpoint, keep=1", "fault", "resume skips it, moves it aside, deletes nothing valid",
            "tests/unit/test_train_checkpoint.py", corrupt_newest),
        Row("resume from an older checkpoint among newer ones", "fault", "trains on, the new saves kept",
            "tests/unit/test_train_checkpoint.py", resume_older),
    ]


def rank_raises(ctx: Ctx) -> Outcome:
    cfg = config(ctx, "raises", extra="debug: {fail_at_step: 12, fail_rank: 1}\ncheckpoint: {interval_steps: 5}")
    out = run(launch(ctx, [*HPCTRAIN, "train", str(cfg)]), ctx.base, timeout=120)
    ckpts = valid_checkpoints(ctx.base / "runs" / "raises" / "checkpoints")
    out.lost = int(newest_step(ckpts) < 10)
    out.ok = out.ended and out.rc != 0 and "rank 1 raised" in out.output and not out.lost
    out.detail = f"rc {out.rc}; newest valid checkpoint step {newest_step(ckpts)}"
    return out


def corrupt_newest(ctx: Ctx) -> Outcome:
    run_dir = ctx.base / "runs" / "corrupt"
    cfg = config(ctx, "corrupt", steps=20, run_dir=run_dir, extra="checkpoint: {interval_steps: 10, keep: 1}")
    first = run(launch(ctx, [*HPCTRAIN, "train", str(cfg)]), ctx.base)
    ckpts = run_dir / "checkpoints"
    before = valid_checkpoints(ckpts)
    bogus = ckpts / "ckpt-000009999.pt"
    if before:
        raw = (ckpts / max(before, key=before.get)).read_bytes()
        bogus.write_bytes(raw[: len(raw) // 2])
    cfg = config(ctx, "corrupt", steps=30, run_dir=run_dir, extra="checkpoint: {interval_steps: 10, keep: 1}")
    out = run(launch(ctx, [*HPCTRAIN, "train", str(cfg), "--resume", "auto"]), ctx.base)
    after = valid_checkpoints(ckpts)
    kept_aside = any(p.name.startswith("ckpt-000009999") for p in run_dir.rglob("*"))
    out.lost = int(not after or newest_step(after) < 30)
    out.ok = first.rc == 0 and out.ended and out.rc == 0 and not out.lost and kept_aside
    out.detail = f"valid after: {sorted(after.values())}; corrupt file kept aside: {kept_aside}"
    return out


def resume_older(ctx: Ctx) -> Outcome:
    run_dir = ctx.base / "runs" / "older"
    cfg = config(ctx, "older", steps=40, run_dir=run_dir, extra="checkpoint: {interval_steps: 10, keep: 2}")
    first = run(launch(ctx, [*HPCTRAIN, "train", str(cfg)]), ctx.base)
    ckpts = run_dir / "checkpoints"
    older = sorted(ckpts.glob("ckpt-*.pt"))[0] if ckpts.is_dir() and list(ckpts.glob("ckpt-*.pt")) else None
    keep_copy = ctx.base / "older-copy.pt"
    if older is not None:
        shutil.copy(older, keep_copy)
    out = run(launch(ctx, [*HPCTRAIN, "train", str(cfg), "--resume", str(keep_copy)]), ctx.base)
    after = valid_checkpoints(ckpts)
    out.lost = int(newest_step(after) < 40)
    out.ok = first.rc == 0 and out.ended and out.rc == 0 and not out.lost and "FileNotFoundError" not in out.output
    out.detail = f"valid after: {sorted(after.values())}"
    return out


# ---- rows: planted payloads --------------------------------------------------------------

class Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload_row(name: str, plant: Callable[[Ctx, Path], List[str]]) -> Row:
    def go(ctx: Ctx) -> Outcome:
        marker = ctx.base / f"PAYLOAD-RAN-{random.randrange(1 << 30)}"
        out = run(plant(ctx, marker), ctx.base, timeout=150)
        out.payload = marker.exists()
        out.clear = is_clear(out)
        out.ok = out.ended and not out.payload
        out.detail = f"rc {out.rc}; payload {'RAN' if out.payload else 'did not run'}"
        return out
    return Row(name, "payload", "refused without running it", "tests/unit/test_train_checkpoint.py", go)


def plant_dp_checkpoint(ctx: Ctx, marker: Path) -> List[str]:
    import torch

    run_dir = ctx.base / "runs" / f"payload-{marker.name}"
    cfg = config(ctx, f"payload-{marker.name}", run_dir=run_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"step": 5, "model": Payload(marker)}, run_dir / "checkpoints" / "ckpt-000000005.pt")
    return launch(ctx, [*HPCTRAIN, "train", str(cfg), "--resume", "auto"])


def plant_stage_file(ctx: Ctx, marker: Path) -> List[str]:
    import torch

    from hpctrain.parallel.checkpoint import stage_checkpoint_path

    folder = ctx.base / f"stages-{marker.name}"
    folder.mkdir()
    for stage in range(2):
        torch.save({"stage": stage, "model": Payload(marker)}, stage_checkpoint_path(str(folder), stage, 2))
    return [sys.executable, "-m", "hpctrain.parallel.checkpoint", "merge", str(folder), "-o", str(folder / "m.pt")]


def payload_rows() -> List[Row]:
    return [payload_row("payload in a checkpoint, --resume auto", plant_dp_checkpoint),
            payload_row("payload in pipeline stage files, merge", plant_stage_file)]


# ---- the matrix --------------------------------------------------------------------------

def all_rows(repeats: int) -> List[Row]:
    faults = [r for r in fault_rows() for _ in range(repeats if r.run.__name__ == "go" else 1)]
    return bad_input_rows() + faults + payload_rows()


def summarise(results: List[tuple]) -> str:
    def count(kind: str, pred: Callable[[Outcome], bool]) -> str:
        rows = [o for r, o in results if r.kind == kind]
        return f"{sum(pred(o) for o in rows)}/{len(rows)}"

    hangs = sum(not o.ended for _, o in results)
    lost = sum(o.lost for _, o in results)
    ran = sum(o.payload for _, o in results)
    return (f"faults survived: {count('fault', lambda o: o.ok)}; bad inputs with a clear one-line error: "
            f"{count('bad input', lambda o: o.clear)}; hangs: {hangs}; checkpoint files lost: {lost}; "
            f"payloads executed: {ran}")


def markdown(results: List[tuple]) -> str:
    lines = ["| kind | case | expected | result | proved by |", "|---|---|---|---|---|"]
    for row, out in results:
        verdict = "ok" if out.ok else "**FAILED**"
        lines.append(f"| {row.kind} | {row.name} | {row.expect} | {verdict} ({out.seconds:.1f} s) | `{row.test}` |")
    return "\n".join(lines) + "\n\n" + summarise(results) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="run each random-kill row this many times")
    ap.add_argument("--only", default="", help="run the rows whose name contains this text")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--verbose", action="store_true", help="print each failing row's output")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    random.seed(args.seed)
    base = Path(tempfile.mkdtemp(prefix="hpctrain-faults-"))
    ctx = Ctx(base, args.ranks)
    make_data(ctx)
    results = []
    for row in all_rows(args.repeats):
        if args.only and args.only not in row.name:
            continue
        out = row.run(ctx)
        if row.kind == "bad input" and not out.clear:
            out.detail = out.detail or f"rc {out.rc}; " + ("traceback" if "Traceback" in out.output else "no HINT")
        results.append((row, out))
        print(f"{'ok    ' if out.ok else 'FAILED'} {row.kind:9} {row.name}: {out.detail or out.rc}", flush=True)
        if args.verbose and not out.ok:
            print("    | " + "\n    | ".join(out.output.strip().splitlines()[-15:]), flush=True)
    print(summarise(results))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    shutil.rmtree(base, ignore_errors=True)
    return 0 if all(o.ok for _, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())

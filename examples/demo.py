#!/usr/bin/env python
"""The main job (``make demo``): digits -> HDF5 -> shards -> multi-rank training -> report.

1. Split scikit-learn's digits set (1797 8x8 images, shipped with scikit-learn) into a
   stratified, shuffled 80 % train / 20 % test split (fixed seed), and pack each part into
   HDF5 with the data tools (``hpctrain data pack``), then verify them.
2. Shard the training file into one shard per rank (``hpctrain data shard``).
3. Train ``examples/digits.yaml`` on N ranks: ``hpctrain launch -n N -- hpctrain train ...``
   (the same as ``mpirun -n N hpctrain train examples/digits.yaml``).
4. Write the report (``hpctrain report RUN_DIR``): PNG plots and a text summary.
5. Print where the run directory, the plots and the checkpoint are, the test accuracy and
   the wall time.

    python examples/demo.py --ranks 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def hpctrain_cmd() -> list:
    exe = BIN / "hpctrain"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hpctrain.cli.main"]


def sh(argv: list, **kw) -> None:
    print("$ " + " ".join(str(a) for a in argv), flush=True)
    subprocess.run([str(a) for a in argv], check=True, **kw)


def split_digits(out_dir: Path, test_fraction: float = 0.2, seed: int = 0) -> tuple:
    """Stratified shuffled split of the digits set into train.npz / test.npz (x float32, y int64)."""
    import numpy as np

    from hpctrain.extras import require

    d = require("sklearn.datasets", "the demo (its digits data)").load_digits()
    x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_idx.extend(idx[: int(round(len(idx) * test_fraction))].tolist())
    test_mask = np.zeros(len(y), bool)
    test_mask[test_idx] = True
    train_idx = rng.permutation(np.flatnonzero(~test_mask))
    test_idx = np.flatnonzero(test_mask)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, idx in (("train", train_idx), ("test", test_idx)):
        p = out_dir / f"{name}.npz"
        np.savez(p, x=x[idx], y=y[idx])
        paths.append(p)
    return paths[0], paths[1], len(train_idx), len(test_idx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="MPI ranks (default 2)")
    ap.add_argument("--config", default=str(ROOT / "examples" / "digits.yaml"))
    ap.add_argument("--data-dir", default=str(ROOT / "runs" / "digits-data"))
    ap.add_argument("--run-dir", default=None, help="default: runs/demo-<date>-<time>")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    hp = hpctrain_cmd()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    data = Path(args.data_dir)
    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S"))

    # 1-2: data. The files are rebuilt every time (a few hundred KiB, well under a second).
    train_npz, test_npz, n_train, n_test = split_digits(data)
    print(f"digits: {n_train} training and {n_test} test samples (stratified 80/20 split, seed 0)")
    sh([*hp, "data", "pack", train_npz, "--out", data / "train.h5", "--quiet"], env=env)
    sh([*hp, "data", "pack", test_npz, "--out", data / "test.h5", "--quiet"], env=env)
    shards = data / "train-shards"
    if shards.is_dir():
        for old in shards.glob("*.h5"):
            old.unlink()
    sh([*hp, "data", "shard", data / "train.h5", "--num-shards", str(args.ranks), "--out", shards, "--quiet"],
       env=env)
    sh([*hp, "data", "verify", data / "test.h5", shards, "--quiet"], env=env, stdout=subprocess.DEVNULL)

    # 3: training on N ranks.
    t_train = time.perf_counter()
    train = [*hp, "launch", "-n", str(args.ranks), "--", *hp, "train", args.config, "--quiet",
             "--set", f"run_dir={run_dir}", "--set", f"data.train=[{shards}]", "--set", f"data.test=[{data / 'test.h5'}]"]
    for o in args.overrides:
        train += ["--set", o]
    sh(train, env=env, cwd=str(ROOT))
    train_s = time.perf_counter() - t_train

    # 4: report.
    sh([*hp, "report", run_dir], env=env)

    summary = json.loads((run_dir / "summary.json").read_text())
    result = summary["result"]
    wall = time.perf_counter() - t0
    acc = result.get("test_accuracy")
    print()
    print("=" * 72)
    print(f"run directory : {run_dir}")
    print(f"plots         : {run_dir / 'report'}/*.png  (summary: {run_dir / 'report' / 'summary.txt'})")
    print(f"timeline      : {run_dir / 'timeline.json'}  (open in https://ui.perfetto.dev)")
    print(f"checkpoint    : {result.get('checkpoint')}")
    print(f"test accuracy : {acc:.4f}" if acc is not None else "test accuracy : (no test set)")
    print(f"wall time     : {wall:.1f} s in total, {train_s:.1f} s of it in `hpctrain train` on {args.ranks} ranks")
    print("=" * 72)
    if acc is None or acc < 0.95:
        print(f"demo: test accuracy {acc} is below the 0.95 target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

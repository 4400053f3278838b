#!/usr/bin/env python
"""Train examples/wine.yaml on N ranks and check its test accuracy.

1. Split scikit-learn's wine set (shipped with scikit-learn) into a stratified 75 % / 25 %
   train/test split with a fixed seed and pack both parts into HDF5 (``hpctrain data pack``).
2. Train ``examples/wine.yaml``: ``hpctrain launch -n N -- hpctrain train examples/wine.yaml``.
3. Print the test accuracy and F1 of the best checkpoint (``checkpoint.keep_best: f1``); exit 1
   when that accuracy is under ``--min-accuracy``.

    python examples/wine.py --ranks 2
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = ROOT / "runs" / "wine-data"


def hpctrain() -> list:
    exe = Path(sys.executable).parent / "hpctrain"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hpctrain.cli.main"]


def make_data(seed: int = 0) -> None:
    import numpy as np
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    d = load_wine()
    x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    DATA.mkdir(parents=True, exist_ok=True)
    for name, (xs, ys) in {"train": (xtr, ytr), "test": (xte, yte)}.items():
        np.savez(DATA / f"{name}.npz", x=xs, y=ys)
        subprocess.run([*hpctrain(), "data", "pack", str(DATA / f"{name}.npz"), "--out", str(DATA / f"{name}.h5"),
                        "--quiet"], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min-accuracy", type=float, default=0.95)
    args = ap.parse_args()
    make_data()
    run_dir = ROOT / "runs" / "wine"
    shutil.rmtree(run_dir, ignore_errors=True)   # the example's own folder: each run starts fresh
    subprocess.run([*hpctrain(), "launch", "-n", str(args.ranks), "--", *hpctrain(), "train",
                    str(HERE / "wine.yaml"), "--set", f"run_dir={run_dir}"], check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    best = [r for r in records if r.get("what") == "best_checkpoint"][-1]
    last = evals[best["step"]]
    stop = [r for r in records if r.get("what") == "early_stop"]
    print(f"wine: best checkpoint (F1) at step {best['step']}: test accuracy {last['test_accuracy']:.4f}, "
          f"F1 {last['test_f1']:.4f}; {'early stop at step %d' % stop[0]['step'] if stop else 'no early stop'}; "
          f"{args.ranks} ranks")
    return 0 if last["test_accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Write a synthetic classification set as .npz (x float32 [N, F], y int64 [N]) for
``hpctrain data pack`` — the input of examples/throughput_mlp.yaml. Labels come from a
fixed random linear teacher, so a model can learn them.

    python examples/make_synthetic.py --out runs/synthetic/train.npz --samples 1100000 --features 256
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=1_100_000)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    teacher = rng.standard_normal((args.features, args.classes)).astype(np.float32)
    x = np.empty((args.samples, args.features), np.float32)
    y = np.empty(args.samples, np.int64)
    for lo in range(0, args.samples, 65536):
        hi = min(lo + 65536, args.samples)
        x[lo:hi] = rng.standard_normal((hi - lo, args.features), dtype=np.float32)
        y[lo:hi] = (x[lo:hi] @ teacher).argmax(1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, x=x, y=y)
    print(f"wrote {args.out}: {args.samples} samples x {args.features} features ({x.nbytes / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

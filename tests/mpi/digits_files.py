"""Shared test data for the runner's MPI tests: a directory every rank sees, and the digits
dataset packed into train/test HDF5 files there (rank 0 writes, everyone waits)."""
import tempfile
from pathlib import Path

import numpy as np

from hpctrain import comm


def shared_dir(prefix: str) -> Path:
    path = tempfile.mkdtemp(prefix=prefix) if comm.rank() == 0 else None
    return Path(comm.broadcast_object(path))


def pack_digits(base: Path, train: slice, test: slice, chunk_rows: int) -> None:
    """Rank 0 writes base/train.h5 and base/test.h5 from those rows of sklearn's digits.
    Not a barrier: callers add their own files, then call comm.barrier()."""
    if comm.rank() != 0:
        return
    from hpctrain.data.pack import pack
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    for name, rows in (("train", train), ("test", test)):
        np.savez(base / f"{name}.npz", x=x[rows], y=y[rows])
        pack([str(base / f"{name}.npz")], str(base / f"{name}.h5"), chunk_rows=chunk_rows, quiet=True)

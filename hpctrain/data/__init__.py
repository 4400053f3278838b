"""HDF5 data for distributed training: a pure partition planner, a rank-aware batch loader,
and the pack / shard / inspect / verify / merge tools. The only package importing h5py.

    from hpctrain.data import HDF5Dataset
    ds = HDF5Dataset("train/", keys=["x", "y"], batch_size=64, seed=0)   # rank/size from comm
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in ds:              # len(ds) steps, equal on every rank
            x, y, real = batch["x"], batch["y"], batch["mask"]

See docs/data.md.
"""
from hpctrain.data.errors import (
    ChecksumError, ConfigError, CorruptFileError, DataError, DtypeError, EmptyDataError, FilterUnavailableError,
    LengthMismatchError, MissingFileError, MissingKeyError, NotHDF5Error, PermissionDeniedError,
    TooFewSamplesError,
)
from hpctrain.data.planner import POLICIES, RankPlan, global_offsets, plan_all, plan_epoch

__all__ = [
    "HDF5Dataset", "HDF5Loader", "roles", "POLICIES", "RankPlan", "plan_epoch", "plan_all", "global_offsets",
    "DataError", "ConfigError", "MissingFileError", "NotHDF5Error", "CorruptFileError",
    "PermissionDeniedError", "MissingKeyError", "LengthMismatchError", "EmptyDataError",
    "TooFewSamplesError", "DtypeError", "ChecksumError", "FilterUnavailableError",
]


def __getattr__(name: str):
    # The loader pulls in torch and h5py: import it only when asked for.
    if name in ("HDF5Dataset", "HDF5Loader"):
        from hpctrain.data import loader

        return getattr(loader, name)
    if name == "roles":
        from hpctrain.data.pack import roles

        return roles
    raise AttributeError(f"module 'hpctrain.data' has no attribute {name!r}")

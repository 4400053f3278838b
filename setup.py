"""The package layout and the C extensions of hpctrain (the metadata is in pyproject.toml)."""
from setuptools import Extension, find_packages, setup

# -fwrapv: signed overflow wraps (defined behaviour) in every kernel
C11 = ["-O3", "-std=c11", "-fwrapv"]

setup(
    # The sbatch templates are the top-level slurm/ folder (where people look for them),
    # installed as the package hpctrain.templates: one copy, read with importlib.resources.
    packages=find_packages(include=["hpctrain", "hpctrain.*"]) + ["hpctrain.templates"],
    package_dir={"hpctrain.templates": "slurm"},
    # All three extensions are optional: without a C compiler the install still succeeds and
    # hpctrain falls back to pure Python / MPI for each (see ARCHITECTURE.md).
    ext_modules=[
        # Shared-memory flag synchronisation (small all-reduces, cheap agreement checks); else
        # MPI barriers and native collectives.
        Extension("hpctrain.comm._shmsync", ["hpctrain/comm/_shmsync.c"], depends=["hpctrain/comm/_kernels.h"],
                  extra_compile_args=C11, optional=True),
        # The ring all-reduce in C over the MPI library mpi4py loaded (no MPI headers needed:
        # hpctrain.comm.mpiring hands it the MPI functions); else the Python ring.
        Extension("hpctrain.comm._mpiring", ["hpctrain/comm/_mpiring.c"], depends=["hpctrain/comm/_kernels.h"],
                  extra_compile_args=C11, optional=True),
        # HDF5 chunk decoders (LZF, unshuffle) that run without the GIL, so that the loader can
        # decompress several chunks at once; else h5py decompresses (serially).
        Extension("hpctrain.data._codecs", ["hpctrain/data/_codecs.c"], extra_compile_args=C11, optional=True),
    ],
)

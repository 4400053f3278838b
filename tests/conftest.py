"""Test layout.

- ``tests/unit/``: pure code, no MPI launcher needed.
- ``tests/mpi/``: pytest modules that run *under* ``mpiexec``; each declares
  ``RANKS = (…)``. They are collected only inside such a launch (``HPCTRAIN_MPI_CHILD=1``);
  ``tests/test_mpi_suites.py`` launches each file at each of its rank counts, with a timeout,
  so that one hang fails one test fast instead of stalling the suite.
- Other top-level tests drive the CLI, SLURM and the multi-node cluster.
"""
import os

if not os.environ.get("HPCTRAIN_MPI_CHILD"):
    collect_ignore_glob = ["mpi/*"]

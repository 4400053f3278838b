"""hpctrain: train PyTorch models on HPC clusters over MPI.

Layers (see ARCHITECTURE.md): ``comm`` (MPI, the only package importing mpi4py) at the
bottom; ``data``, ``torch``, ``probe``, ``slurm``, ``parallel`` above it; ``train`` and
``cli`` on top.
"""
__version__ = "0.1.0"

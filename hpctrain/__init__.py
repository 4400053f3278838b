"""hpctrain: train PyTorch models on HPC clusters over MPI.

Layers (see ARCHITECTURE.md): ``comm`` (MPI, the only package importing mpi4py) at the
bottom; ``data``, ``torch``, ``probe``, ``slurm``, ``parallel`` above it; ``train`` and
``cli`` on top.
"""
__version__ = "0.1.0"

__all__ = ["load_model", "__version__"]


def __getattr__(name: str):
    # torch is imported on first use of load_model, so `import hpctrain` (and the CLI's start)
    # stays light.
    if name == "load_model":
        from hpctrain.train.export import load_model

        return load_model
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")

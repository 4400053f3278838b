"""The sbatch templates. This folder is installed as the package ``hpctrain.templates``
(``package-dir`` in pyproject.toml), so the files here are the ones ``hpctrain slurm``
renders in every install; ``hpctrain.slurm.render`` reads them with importlib.resources."""

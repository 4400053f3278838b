"""The ``parallel:`` section of a ``hpctrain train`` config, typed and validated (pure).

    parallel:
      pipeline_stages: 2      # S; the world must be a multiple of S (the rest is data parallel)
      micro_batches: 8        # M; the per-replica batch is cut into M micro-batches
      schedule: 1f1b          # or gpipe
      balance: params         # or time (needs a sample batch), ignored with split_points/sizes
      split_points: [5]       # optional: first layer index of stages 1…S−1
      sizes: null             # optional: layers per stage, e.g. [4, 3]

The runner builds the pipeline with :meth:`ParallelConfig.build`; with ``pipeline_stages: 1``
(the default) there is no pipeline and the runner keeps plain data parallelism.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional

from .partition import BALANCE_MODES
from .schedule import normalize_schedule


@dataclass(frozen=True)
class ParallelConfig:
    """Validated pipeline settings; ``from_dict`` rejects unknown keys by listing the valid ones."""

    pipeline_stages: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    balance: str = "params"
    split_points: Optional[List[int]] = None
    sizes: Optional[List[int]] = None

    def __post_init__(self) -> None:
        for name in ("pipeline_stages", "micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel.{name} must be an integer ≥ 1, got {v!r}")
        object.__setattr__(self, "schedule", normalize_schedule(self.schedule))
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"parallel.balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}")
        if self.split_points is not None and self.sizes is not None:
            raise ValueError("parallel: give split_points or sizes, not both")
        for name in ("split_points", "sizes"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                    raise ValueError(f"parallel.{name} must be a list of integers, got {v!r}")
                object.__setattr__(self, name, list(v))
        if self.split_points is not None and len(self.split_points) != self.pipeline_stages - 1:
            raise ValueError(f"parallel.split_points needs {self.pipeline_stages - 1} entries for "
                             f"{self.pipeline_stages} stages, got {self.split_points}")
        if self.sizes is not None and len(self.sizes) != self.pipeline_stages:
            raise ValueError(f"parallel.sizes needs {self.pipeline_stages} entries, got {self.sizes}")

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "ParallelConfig":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"parallel: expected a mapping, got {type(data).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"parallel: unknown key(s) {unknown}; valid: {', '.join(valid)}")
        return cls(**dict(data))

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @property
    def enabled(self) -> bool:
        """True when a pipeline is asked for (more than one stage)."""
        return self.pipeline_stages > 1

    def check(self, model: Any, world_size: int) -> None:
        """Pure pre-flight of a pipeline of ``model`` on ``world_size`` ranks: raises ValueError
        (the same on every rank, before any communication) when there are more stages than
        ranks, the world is not a multiple of the stages, the model is not an nn.Sequential or
        a list of modules, or it cannot be split as asked (too few layers, bad split points)."""
        from .hybrid import check_world
        from .partition import plan_partition
        from .pipeline import parameter_costs, sequence_layers

        check_world(world_size, self.pipeline_stages)
        try:
            layers = sequence_layers(model)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        costs = parameter_costs(layers)
        if self.balance == "time" and self.split_points is None and self.sizes is None:
            plan_partition(costs, self.pipeline_stages)  # the layer count; the split is measured later
        else:
            plan_partition(costs, self.pipeline_stages, split_points=self.split_points, sizes=self.sizes)

    def build(self, model: Any, sample_input: Any = None, group: Any = None, device: Any = None) -> Any:
        """The :class:`~hpctrain.parallel.pipeline.PipelineModule` these settings describe."""
        from .pipeline import PipelineModule

        return PipelineModule(model, stages=self.pipeline_stages, micro_batches=self.micro_batches,
                              schedule=self.schedule, balance=self.balance, split_points=self.split_points,
                              sizes=self.sizes, sample_input=sample_input, group=group, device=device)

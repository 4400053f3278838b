"""hpctrain.parallel — pipeline model parallelism (GPipe, 1F1B) and hybrid data × pipeline.

    from hpctrain.parallel import PipelineModule, distributed_optimizer
    pipe = PipelineModule(model, stages=2, micro_batches=8, schedule="1f1b")   # model: nn.Sequential
    opt = distributed_optimizer(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
    loss = pipe.train_step(x, y, torch.nn.functional.cross_entropy); opt.step(); opt.zero_grad()

Pure plans: :mod:`.partition` (which layers on which stage), :mod:`.schedule` (which micro-batch
when, message order, bubble). Execution: :mod:`.pipeline`; groups and gradient averaging:
:mod:`.hybrid`; per-stage checkpoints and the merge tool: :mod:`.checkpoint`.
"""
from .partition import PartitionError, PartitionPlan, balance, plan_partition, split_rows
from .schedule import SCHEDULES, Schedule, ScheduleError, bubble_fraction, make_program, make_schedule, simulate
from .hybrid import HybridLayout, check_world, distributed_optimizer, make_groups
from .pipeline import PipelineModule, StepStats, measure_layer_times, parameter_costs, sequence_layers
from .config import ParallelConfig
from .checkpoint import load_stage_checkpoint, merge_stage_checkpoints, save_stage_checkpoint, stage_checkpoint_path

__all__ = [
    "PipelineModule", "StepStats", "ParallelConfig", "distributed_optimizer",
    "HybridLayout", "check_world", "make_groups", "PartitionPlan", "PartitionError", "plan_partition", "balance",
    "split_rows", "SCHEDULES", "Schedule", "ScheduleError", "make_schedule", "make_program", "simulate",
    "bubble_fraction", "measure_layer_times", "parameter_costs", "sequence_layers", "save_stage_checkpoint",
    "load_stage_checkpoint", "merge_stage_checkpoints", "stage_checkpoint_path",
]

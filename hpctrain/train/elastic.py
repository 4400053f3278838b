"""The training runner in an elastic job (``elastic.min_ranks`` >= 1, started with
``hpctrain launch --elastic``): when ranks die, the survivors re-form the world
(``hpctrain.comm.reform``), and ``Trainer.fit`` builds the run again on them, resuming from
the last checkpoint with the data planned over the new number of ranks. The loss is recorded
in metrics.jsonl (an event ``ranks_lost``), summary.json and the report. docs/elastic.md.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

from hpctrain import comm
from hpctrain.comm import faults
from hpctrain.train.config import ConfigError, TrainConfig

log = logging.getLogger("hpctrain.train")


def check_job(cfg: TrainConfig) -> None:
    """A config that asks for elastic mode in a job that cannot survive a lost rank, or for a
    minimum above the job's rank count, stops here, on every rank alike, with what to do."""
    if not cfg.elastic.min_ranks:
        return
    if not faults.enabled():
        raise ConfigError(f"elastic.min_ranks={cfg.elastic.min_ranks}, but this job is not elastic (a lost rank "
                          f"would end it). {faults.HOW_TO_ENABLE}; or remove elastic.min_ranks")
    if cfg.elastic.min_ranks > comm.size():
        raise ConfigError(f"elastic.min_ranks={cfg.elastic.min_ranks} is more than the {comm.size()} ranks this "
                          "job has. HINT: start more ranks or lower elastic.min_ranks")


def recoverable(cfg: TrainConfig, exc: BaseException) -> bool:
    """A lost rank, in a run that goes on without it."""
    return bool(cfg.elastic.min_ranks) and faults.enabled() and faults.is_failure(exc)


def recover(cfg: TrainConfig, run: Any, step: int) -> Dict[str, Any]:
    """After a lost rank, on every survivor: close the run's outputs, stop its optimizer from
    following the new world (the run is rebuilt with a new one), re-form the world (raises
    ElasticError below ``elastic.min_ranks``). Returns the record of the loss."""
    opt = getattr(run.step_impl, "opt", None)
    if opt is not None and hasattr(opt, "follow_reforms"):
        opt.follow_reforms = False
    if run.metrics is not None:
        run.metrics.close()
    if run.tb is not None:
        run.tb.close()
    comm.reform(min_ranks=max(1, cfg.elastic.min_ranks))
    event = comm.reforms()[-1]
    loss = {"step": step, "lost": event["lost_launched"], "ranks_before": event["old_size"],
            "ranks": event["new_size"], "reform_seconds": round(event["seconds"], 4)}
    if comm.rank() == 0:
        log.warning("elastic: lost launched rank(s) %s in step %d; continuing on %d rank(s) from the last "
                    "checkpoint", ", ".join(map(str, loss["lost"])), step, loss["ranks"])
    return loss


def record_losses(run: Any, losses: List[Dict[str, Any]]) -> None:
    """The last loss, as an event of the rebuilt run's metrics (rank 0), with the step it
    resumed from."""
    if not losses:
        return
    losses[-1]["resumed_step"] = run.step
    comm.note_reform(resumed_from={"step": run.step})
    if run.rank == 0:
        run.metrics.write({"kind": "event", "what": "ranks_lost", **losses[-1]})

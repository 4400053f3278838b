"""Apply a binding plan: select the GPU and set torch's CPU thread count.

The decision itself is ``decide.plan_binding`` (pure); this module only carries it out and
logs it (warnings from every rank that has them — oversubscription is per node news).
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional

from .decide import BindingPlan, plan_binding
from .facts import RankFacts

log = logging.getLogger("hpctrain.probe")


def bind(facts: Optional[RankFacts] = None, threads: Optional[int] = None, device: str = "auto",
         env: Optional[Mapping[str, str]] = None, apply: bool = True) -> BindingPlan:
    """Choose this rank's device and thread count (see ``plan_binding``) and apply them:
    ``torch.cuda.set_device`` and ``torch.set_num_threads``. Returns the plan; its
    ``device`` is what to pass to ``model.to(...)``."""
    import os

    import torch

    if facts is None:
        from .collect import collect_facts

        facts = collect_facts()
    plan = plan_binding(facts, threads=threads, device=device, env=os.environ if env is None else env)
    if apply:
        if plan.cuda_index is not None:
            torch.cuda.set_device(plan.cuda_index)
        if torch.get_num_threads() != plan.threads:
            torch.set_num_threads(plan.threads)
    for w in plan.warnings:
        log.warning("rank %d: %s", facts.rank, w)
    if facts.rank == 0:
        log.info("rank 0 binding: %s, %d thread(s) (%s)", plan.device, plan.threads, "; ".join(plan.reasons))
    return plan

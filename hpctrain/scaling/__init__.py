"""Predict step time and scaling efficiency beyond the machines at hand.

- :mod:`.fabrics`: link costs (α, β) by name or number;
- :mod:`.model`: closed-form α-β-γ costs of each all-reduce algorithm, walking the runtime's
  own ring schedule (``hpctrain.comm.plan``);
- :mod:`.profile`: what a prediction starts from (written by ``hpctrain bench calibrate`` or
  by hand);
- :mod:`.predict`: the overlap of all-reduce with backward over the runtime's bucket plan
  (``hpctrain.torch.buckets.plan_buckets``), step time, samples/s, efficiency per node count;
- :mod:`.simulate`: event-time simulation of the ring and hierarchical schedules (segments,
  shared ports, stragglers);
- :mod:`.published`: profiles of published runs (the model's validation).

Pure: no MPI; torch is imported only when a bucket plan is made. Nothing is imported here,
so ``hpctrain plan --help`` stays light.
"""

"""Decisions from facts, as pure functions: which device and how many threads a rank
gets, how much memory its trials may use, which batch the ranks agree on, how the learning
rate scales, and what looks wrong. Unit-tested with recorded facts (a CPU-only box, an
8×H100 node, a node with GPUs of different memory) — no GPU, no MPI needed.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpctrain.settings import parse_size

from .facts import GpuFacts, RankFacts

LR_RULES = ("linear", "sqrt", "none")


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """A positive memory size: '2GiB' → 2147483648, '500MB' → 500 MiB, '1.5G' → 1.5 GiB,
    '4096' → 4096 (:func:`hpctrain.settings.parse_size`: every unit a power of 1024)."""
    value = parse_size(text)
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


# --------------------------------------------------------------------------- binding
@dataclass(frozen=True)
class BindingPlan:
    """Where one rank runs: ``device`` is "cpu" or "cuda:<ordinal>" (ordinal after
    CUDA_VISIBLE_DEVICES); ``gpu`` the physical GPU (NVML index) when known; ``threads`` the
    intra-op CPU threads for torch.set_num_threads."""

    rank: int
    local_rank: int
    local_size: int
    device: str
    gpu: Optional[int]
    threads: int
    cores: int  # CPU cores this rank's node (or allocation) offers
    reasons: Tuple[str, ...]
    warnings: Tuple[str, ...]

    @property
    def cuda_index(self) -> Optional[int]:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda:") else None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {self.threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")


def _int_list(text: Optional[str]) -> Optional[List[int]]:
    if not text:
        return None
    try:
        from .collect import parse_cpulist

        return list(parse_cpulist(text))
    except ValueError:
        return None


def usable_cuda_ordinals(facts: RankFacts) -> Tuple[List[int], List[str]]:
    """CUDA ordinals this rank may choose from, and why."""
    inv = facts.gpus
    reasons: List[str] = []
    if not inv.torch_cuda_available or inv.torch_device_count == 0:
        if inv.count:
            reasons.append(f"the node has {inv.count} GPU(s) but torch cannot use them "
                           f"(torch CUDA {inv.torch_cuda_version or 'absent'}, CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices!r})")
        return [], reasons
    n = inv.torch_device_count
    if inv.cuda_visible_devices is not None:
        reasons.append(f"CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices!r} leaves {n} GPU(s) visible")
        return list(range(n)), reasons
    slurm_gpus = _int_list(facts.slurm.step_gpus) or _int_list(facts.slurm.job_gpus)
    if slurm_gpus:
        allowed = [g for g in slurm_gpus if g < n]
        reasons.append(f"SLURM allocated GPUs {slurm_gpus} (SLURM_STEP_GPUS/SLURM_JOB_GPUS) and "
                       "CUDA_VISIBLE_DEVICES is unset: choosing among them")
        return allowed, reasons
    return list(range(n)), reasons


def plan_binding(facts: RankFacts, threads: Optional[int] = None, device: str = "auto",
                 env: Optional[Mapping[str, str]] = None) -> BindingPlan:
    """Local rank → GPU, and CPU threads = cores per node / ranks per node.

    * GPUs: the CUDA ordinals this process sees (after CUDA_VISIBLE_DEVICES, or restricted
      to SLURM_STEP_GPUS when that is unset). One visible GPU → use it (SLURM or the user
      bound the task). At least as many as local ranks → ``local_rank``-th. Fewer →
      ranks share them round-robin (with a warning).
    * Threads: an explicit ``threads`` wins, then OMP_NUM_THREADS, then SLURM's
      --cpus-per-task, then the CPUs this process is bound to (mpiexec --bind-to, srun
      --cpu-bind), else physical cores of the node divided by ranks on the node.
    """
    env = env or {}
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    reasons: List[str] = []
    warnings: List[str] = []
    chosen, gpu = ("cpu", None) if device == "cpu" else _pick_gpu(facts, device, reasons, warnings)
    n_threads, cores = _pick_threads(facts, threads, env, reasons, warnings)
    return BindingPlan(facts.rank, facts.local_rank, max(1, facts.local_size), chosen, gpu, n_threads, cores,
                       tuple(reasons), tuple(warnings))


def _pick_gpu(facts: RankFacts, device: str, reasons: List[str], warnings: List[str]) -> Tuple[str, Optional[int]]:
    """``plan_binding``'s device for ``device`` "auto" or "cuda": ("cuda:N", the GPU's probe
    index) or ("cpu", None) where no GPU is usable; appends its reasons and warnings."""
    lr, ls = facts.local_rank, max(1, facts.local_size)
    chosen = "cpu"
    gpu: Optional[int] = None
    ordinals, why = usable_cuda_ordinals(facts)
    reasons.extend(why)
    if not ordinals:
        if device == "cuda":
            raise ValueError(
                f"rank {facts.rank} on {facts.hostname}: device 'cuda' asked for, but no usable GPU "
                f"({'; '.join(why) or 'no GPU found: ' + '; '.join(facts.gpus.notes)}).\n"
                "HINT: run on a GPU node, check CUDA_VISIBLE_DEVICES, or use --device cpu")
        reasons.append("no usable GPU: running on CPU")
    else:
        if len(ordinals) == 1:
            ordinal = ordinals[0]
            if ls > 1:
                if facts.gpus.cuda_visible_devices is not None and facts.gpus.cuda_visible_devices.count(",") == 0:
                    reasons.append("one GPU visible to this rank (bound per task)")
                else:
                    warnings.append(f"{ls} ranks on {facts.hostname} share 1 GPU: memory is split between them.\n"
                                    "HINT: one rank per GPU (srun --gpus-per-task=1, or fewer ranks)")
        elif len(ordinals) >= ls:
            ordinal = ordinals[lr]
            reasons.append(f"local rank {lr} of {ls} → GPU ordinal {ordinal} of {len(ordinals)}")
            if len(ordinals) > ls and lr == 0:
                warnings.append(f"{len(ordinals)} GPUs visible on {facts.hostname} but only {ls} rank(s) there: "
                                f"{len(ordinals) - ls} GPU(s) stay idle.\nHINT: start one rank per GPU")
        else:
            ordinal = ordinals[lr % len(ordinals)]
            sharing = sum(1 for r in range(ls) if r % len(ordinals) == lr % len(ordinals))
            warnings.append(f"{ls} ranks on {facts.hostname} but {len(ordinals)} GPUs: {sharing} ranks share GPU "
                            f"ordinal {ordinal}.\nHINT: start one rank per GPU")
            reasons.append(f"local rank {lr} → GPU ordinal {ordinal} (round-robin)")
        chosen = f"cuda:{ordinal}"
        visible = facts.gpus.visible_gpus()
        if facts.gpus.visible is not None and ordinal < len(visible):
            gpu = visible[ordinal].index
    return chosen, gpu


def _pick_threads(facts: RankFacts, threads: Optional[int], env: Mapping[str, str], reasons: List[str],
                  warnings: List[str]) -> Tuple[int, int]:
    """``plan_binding``'s (CPU threads, physical cores of the node); appends its reasons and
    warnings."""
    ls = max(1, facts.local_size)
    cpus = facts.cpus
    logical = max(1, cpus.logical)
    physical = cpus.physical or logical
    smt = max(1, logical // physical)
    cores = physical
    bound = cpus.affinity is not None and 0 < len(cpus.affinity) < logical
    omp = env.get("OMP_NUM_THREADS", cpus.omp_num_threads)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        n_threads = threads
        reasons.append(f"{threads} thread(s): asked for")
    elif omp and omp.strip().isdigit() and int(omp) > 0:
        n_threads = int(omp)
        reasons.append(f"{n_threads} thread(s): OMP_NUM_THREADS={omp}")
    elif facts.slurm.cpus_per_task:
        n_threads = max(1, facts.slurm.cpus_per_task // smt)
        reasons.append(f"{n_threads} thread(s): SLURM --cpus-per-task={facts.slurm.cpus_per_task}")
    elif bound:
        n_threads = max(1, len(cpus.affinity or ()) // smt)
        reasons.append(f"{n_threads} thread(s): this rank is bound to CPUs {_ranges(cpus.affinity or ())}")
    else:
        n_threads = max(1, cores // ls)
        reasons.append(f"{n_threads} thread(s): {cores} cores / {ls} rank(s) on {facts.hostname}")
    if ls > cores:
        warnings.append(f"{ls} ranks on {facts.hostname} oversubscribe its {cores} cores: they will slow each "
                        f"other down.\nHINT: start at most {cores} ranks per node (or one per GPU)")
    elif n_threads * ls > cores and not bound:
        warnings.append(f"{ls} ranks × {n_threads} threads = {n_threads * ls} > {cores} cores on {facts.hostname}: "
                        f"threads will compete.\nHINT: set OMP_NUM_THREADS={max(1, cores // ls)} or leave it unset")
    return n_threads, cores


def _ranges(values: Sequence[int]) -> str:
    values = sorted(values)
    out: List[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}-{values[j]}" if j > i else str(values[i]))
        i = j + 1
    return ",".join(out)


# --------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class Budget:
    """The memory one rank's batch-size trials may use on its device, and where that
    number comes from."""

    rank: int
    hostname: str
    device: str
    bytes: int
    source: str
    gpu_name: Optional[str] = None


def rank_budget(facts: RankFacts, plan: BindingPlan, max_memory: Optional[int] = None,
                shared_by: Optional[int] = None) -> Budget:
    """What this rank may use: on a GPU, its free memory (total if unknown) divided among
    the ranks sharing it; on CPU, available RAM (or the cgroup limit, or SLURM's
    --mem) divided by ranks on the node. ``max_memory`` caps either."""
    if plan.device.startswith("cuda"):
        visible = facts.gpus.visible_gpus()
        idx = plan.cuda_index or 0
        g: Optional[GpuFacts] = visible[idx] if idx < len(visible) else None
        share = shared_by or 1
        if g is None or (g.memory_free is None and g.memory_total is None):
            if max_memory is None:
                raise ValueError(f"rank {facts.rank}: memory of {plan.device} unknown.\n"
                                 "HINT: pass --max-memory (e.g. --max-memory 20GiB)")
            return Budget(facts.rank, facts.hostname, plan.device, max_memory, "--max-memory (GPU memory unknown)")
        free = g.memory_free if g.memory_free is not None else int(0.95 * (g.memory_total or 0))
        what = "free" if g.memory_free is not None else "95% of total"
        amount = free // share
        source = f"{format_bytes(free)} {what} on GPU {g.index} ({g.name})" + (f" / {share} ranks" if share > 1 else "")
        if max_memory is not None and max_memory < amount:
            return Budget(facts.rank, facts.hostname, plan.device, max_memory, f"--max-memory (below {source})", g.name)
        return Budget(facts.rank, facts.hostname, plan.device, amount, source, g.name)
    mem = facts.memory
    pool, what = mem.available, "available RAM"
    if mem.cgroup_limit is not None and mem.cgroup_limit < pool:
        pool, what = mem.cgroup_limit, "cgroup memory limit"
    if facts.slurm.mem_per_node_mb and facts.slurm.mem_per_node_mb * (1 << 20) < pool:
        pool, what = facts.slurm.mem_per_node_mb * (1 << 20), "SLURM --mem"
    share = shared_by or max(1, facts.local_size)
    amount = pool // share
    source = f"{format_bytes(pool)} {what} on {facts.hostname} / {share} rank(s)"
    if max_memory is not None:
        if max_memory > amount:
            return Budget(facts.rank, facts.hostname, "cpu", max_memory,
                          f"--max-memory (above the {format_bytes(amount)} share of {what}: risky)")
        return Budget(facts.rank, facts.hostname, "cpu", max_memory, "--max-memory")
    return Budget(facts.rank, facts.hostname, "cpu", amount, source)


@dataclass(frozen=True)
class MemoryPlan:
    budgets: Tuple[Budget, ...]
    smallest: Budget
    message: str


def plan_memory(all_facts: Sequence[RankFacts], plans: Sequence[BindingPlan],
                max_memory: Optional[int] = None) -> MemoryPlan:
    """Every rank's budget, with GPUs shared by several ranks split between them. The
    batch all ranks use is bounded by the smallest budget; the message says whose."""
    if len(all_facts) != len(plans) or not plans:
        raise ValueError(f"plan_memory: {len(all_facts)} facts but {len(plans)} binding plans")
    sharing: Dict[Tuple[str, str], int] = defaultdict(int)
    for f, p in zip(all_facts, plans):
        if p.device != "cpu":
            sharing[(f.hostname, str(p.gpu if p.gpu is not None else p.device))] += 1
    budgets = []
    for f, p in zip(all_facts, plans):
        share = sharing.get((f.hostname, str(p.gpu if p.gpu is not None else p.device))) if p.device != "cpu" else None
        budgets.append(rank_budget(f, p, max_memory, share))
    smallest = min(budgets, key=lambda b: (b.bytes, b.rank))
    distinct = sorted({b.bytes for b in budgets})
    if len(distinct) == 1:
        message = f"every rank has the same budget: {format_bytes(smallest.bytes)} ({smallest.source})"
    else:
        groups: Dict[int, List[int]] = defaultdict(list)
        for b in budgets:
            groups[b.bytes].append(b.rank)
        parts = ", ".join(f"{format_bytes(v)} (ranks {_ranges(groups[v])})" for v in sorted(groups, reverse=True))
        message = (f"memory differs between ranks: {parts}; the smallest wins: rank {smallest.rank} on "
                   f"{smallest.hostname} ({smallest.source}) bounds the per-device batch of every rank")
    return MemoryPlan(tuple(budgets), smallest, message)


# --------------------------------------------------------------------------- agreeing, scaling
@dataclass(frozen=True)
class RankChoice:
    rank: int
    hostname: str
    device: str
    budget: int
    batch: int


def agree_batch(choices: Sequence[RankChoice]) -> Tuple[int, str]:
    """The batch every rank can run (the minimum) and a sentence on who limited it."""
    if not choices:
        raise ValueError("agree_batch: no ranks")
    low = min(choices, key=lambda c: (c.batch, c.rank))
    batches = {c.batch for c in choices}
    if len(batches) == 1:
        return low.batch, f"all {len(choices)} rank(s) found {low.batch}"
    high = max(choices, key=lambda c: c.batch)
    return low.batch, (f"ranks differ ({low.batch}..{high.batch}); the smallest wins: rank {low.rank} on "
                       f"{low.hostname} ({low.device}, budget {format_bytes(low.budget)}) fits only {low.batch}")


@dataclass(frozen=True)
class LrDecision:
    lr: float
    rule: str
    factor: float
    warmup_epochs: float
    warmup_steps: Optional[int]
    explanation: str


def scale_learning_rate(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear",
                        warmup_epochs: float = 5.0, steps_per_epoch: Optional[int] = None) -> LrDecision:
    """Scale ``base_lr`` (tuned for ``base_batch``) to ``global_batch``.

    * ``linear`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr × k with
      k = global/base, reached by a gradual warm-up from base_lr over ``warmup_epochs``
      (they used 5) — for SGD with momentum.
    * ``sqrt`` (Krizhevsky 2014; Hoffer et al. 2017): lr × √k, keeps the gradient-noise
      scale; common for Adam-type optimizers. Warm-up is still advised for large k.
    * ``none``: keep base_lr.
    """
    if rule not in LR_RULES:
        raise ValueError(f"unknown learning-rate rule {rule!r}; choose one of {', '.join(LR_RULES)}")
    if base_lr <= 0 or not math.isfinite(base_lr):
        raise ValueError(f"base learning rate must be a positive number, got {base_lr}")
    if base_batch < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be ≥ 1, got base {base_batch}, global {global_batch}")
    k = global_batch / base_batch
    factor = {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]
    lr = base_lr * factor
    warm = warmup_epochs if rule != "none" and factor > 1.0 else 0.0
    steps = int(math.ceil(warm * steps_per_epoch)) if steps_per_epoch and warm else None
    if rule == "linear":
        why = (f"linear scaling (Goyal et al. 2017): {base_lr:g} × {global_batch}/{base_batch} = {lr:.6g}")
    elif rule == "sqrt":
        why = f"square-root scaling: {base_lr:g} × √({global_batch}/{base_batch}) = {lr:.6g}"
    else:
        why = f"no scaling: {lr:.6g}"
    if warm:
        why += (f"; warm up linearly from {base_lr:g} over {warm:g} epochs"
                + (f" ({steps} steps)" if steps else ""))
    return LrDecision(lr, rule, factor, warm, steps, why)


def global_batch_size(per_device: int, world_size: int, accumulation_steps: int = 1) -> int:
    if per_device < 1 or world_size < 1 or accumulation_steps < 1:
        raise ValueError(f"per-device batch, world size and accumulation steps must be ≥ 1; got "
                         f"{per_device}, {world_size}, {accumulation_steps}")
    return per_device * world_size * accumulation_steps


# --------------------------------------------------------------------------- checks
def check_rank(facts: RankFacts) -> List[str]:
    """What looks wrong with one rank's set-up, each with a HINT."""
    out: List[str] = []
    env_size = facts.launcher.env_size
    if env_size is not None and facts.mpi.error is None and facts.mpi.size == 1 and env_size > 1:
        out.append(f"the launcher ({facts.launcher.detail}) started {env_size} tasks but MPI sees a world of 1: "
                   "each rank runs alone.\nHINT: under SLURM use `srun --mpi=pmix` (or mpirun inside the job)")
    if facts.slurm.ntasks and facts.mpi.error is None and facts.size > 1 and facts.slurm.ntasks != facts.size \
            and facts.launcher.kind == "srun":
        out.append(f"SLURM_NTASKS={facts.slurm.ntasks} but MPI world size is {facts.size}.\n"
                   "HINT: launch with srun -n $SLURM_NTASKS --mpi=pmix")
    if facts.mpi.error:
        out.append(f"MPI facts unavailable: {facts.mpi.error}")
    for note in facts.gpus.notes:
        if note.startswith("CUDA_VISIBLE_DEVICES"):
            out.append(note + "\nHINT: check CUDA_VISIBLE_DEVICES against `nvidia-smi -L`")
    for d in facts.disks:
        if d.free is not None and d.free < (1 << 30):
            out.append(f"only {format_bytes(d.free)} free at the {d.role} directory {d.path}.\n"
                       "HINT: free space or point it at a larger file system")
    return out


def check_cluster(all_facts: Sequence[RankFacts]) -> List[str]:
    """What differs between ranks that should not (or that the user should know)."""
    out: List[str] = []
    if not all_facts:
        return out
    libs = defaultdict(list)
    torches = defaultdict(list)
    for f in all_facts:
        libs[f.mpi.library_version or "unknown"].append(f.rank)
        torches[f.torch_version].append(f.rank)
    if len(libs) > 1:
        out.append("ranks use different MPI libraries: " + "; ".join(f"{k} (ranks {_ranges(v)})" for k, v in libs.items())
                   + "\nHINT: use one MPI installation (module load) on every node")
    if len(torches) > 1:
        out.append("ranks use different torch versions: " + "; ".join(f"{k} (ranks {_ranges(v)})" for k, v in torches.items()))
    per_node: Dict[str, int] = defaultdict(int)
    for f in all_facts:
        per_node[f.hostname] += 1
    if len(set(per_node.values())) > 1:
        out.append("nodes run different numbers of ranks: " + ", ".join(f"{h}: {n}" for h, n in per_node.items()))
    gpu_kinds = defaultdict(set)
    for f in all_facts:
        for g in f.gpus.visible_gpus():
            gpu_kinds[(g.name, g.memory_total)].add(f.hostname)
    if len(gpu_kinds) > 1:
        out.append("GPUs differ: " + "; ".join(f"{name} {format_bytes(mem)} on {', '.join(sorted(hosts))}"
                                               for (name, mem), hosts in gpu_kinds.items())
                   + " — the smallest memory bounds the per-device batch")
    return out

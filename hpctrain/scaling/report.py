"""Text table and PNG plot of a :func:`hpctrain.scaling.predict.plan_scaling` result."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from hpctrain.settings import format_size

__all__ = ["format_table", "write_plot"]


def _best_per_algorithm(result: Dict[str, Any]) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """Per node count, per algorithm, its point at its own best threshold."""
    out: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for p in result["points"]:
        here = out.setdefault(p["nodes"], {})
        if p["algorithm"] not in here or p["step_s"] < here[p["algorithm"]]["step_s"]:
            here[p["algorithm"]] = p
    return out


def format_table(result: Dict[str, Any]) -> str:
    """The summary (best point per node count) and each algorithm's step time."""
    lines = [f"profile {result['profile']}: {result['ranks_per_node']} rank(s) per node; one rank alone "
             f"{result['single_rank_step_s'] * 1e3:.1f} ms per step",
             f"{'nodes':>6} {'ranks':>6} {'best':>18} {'fusion':>8} {'step_ms':>9} {'comm_ms':>9} "
             f"{'hidden':>7} {'samples/s':>11} {'effic.':>7}"]
    for row in result["summary"]:
        b = row["best"]
        lines.append(f"{row['nodes']:>6} {row['ranks']:>6} {b['algorithm']:>18} {format_size(b['fusion_threshold']):>8} "
                     f"{b['step_s'] * 1e3:>9.2f} {b['comm_s'] * 1e3:>9.2f} {b['hidden_fraction'] * 100:>6.0f}% "
                     f"{b['samples_per_s']:>11.1f} {b['efficiency'] * 100:>6.1f}%")
    if result.get("straggler"):
        lines.append("")
        lines.append(f"with one rank {result['straggler'] * 100:.0f}% slower (the best configuration above):")
        for row in result["summary"]:
            s = row.get("with_straggler")
            if s:
                lines.append(f"{row['nodes']:>6} {row['ranks']:>6} step {s['step_s'] * 1e3:.2f} ms, "
                             f"efficiency {s['efficiency'] * 100:.1f}%")
    per = _best_per_algorithm(result)
    algos: List[str] = list(result["algorithms"])
    lines.append("")
    lines.append("step ms per algorithm (each at its best fusion threshold):")
    lines.append(f"{'nodes':>6} " + " ".join(f"{a:>18}" for a in algos))
    for n in sorted(per):
        lines.append(f"{n:>6} " + " ".join(f"{per[n][a]['step_s'] * 1e3:>18.2f}" for a in algos if a in per[n]))
    return "\n".join(lines) + "\n"


def write_plot(result: Dict[str, Any], path: str) -> Path:
    """Efficiency and step time vs node count, one line per algorithm, on a figure of its own
    (no pyplot: the caller's matplotlib state stays as it was)."""
    from hpctrain.extras import require

    require("matplotlib", "hpctrain plan --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    eff, step = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    per = _best_per_algorithm(result)
    nodes = sorted(per)
    for algo in result["algorithms"]:
        xs = [n for n in nodes if algo in per[n]]
        eff.plot(xs, [per[n][algo]["efficiency"] * 100 for n in xs], marker="o", label=algo)
        step.plot(xs, [per[n][algo]["step_s"] * 1e3 for n in xs], marker="o", label=algo)
    for ax, label in ((eff, "scaling efficiency (%)"), (step, "step time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"nodes ({result['ranks_per_node']} rank(s) each)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    eff.set_ylim(0, 105)
    step.set_yscale("log")
    eff.legend(fontsize=7)
    fig.suptitle(f"hpctrain plan: {result['profile']}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out

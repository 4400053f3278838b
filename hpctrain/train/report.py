"""``hpctrain report RUN_DIR``: PNG plots and a short text summary of a run directory.

Reads ``metrics.jsonl`` (and ``summary.json`` when present) and writes, under
``RUN_DIR/report/``:

- ``loss.png`` — training loss per step and test loss / test accuracy at each evaluation;
- ``throughput.png`` — samples per second per step (and a moving average);
- ``compute_comm.png`` — mean time per step on each rank split into data-wait, forward,
  backward, communication and optimizer;
- ``rank_step_time.png`` — each rank's step time over the run (stragglers stand out);
- ``summary.txt`` — the numbers a person wants first.

Plots are drawn on figures of their own with matplotlib's Agg canvas (no display needed, and
the caller's matplotlib backend and settings are left alone). matplotlib is an optional
dependency: ``pip install 'hpctrain[report]'``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hpctrain.extras import require
from hpctrain.train.metrics import read_metrics


class ReportError(ValueError):
    """The run directory holds nothing to report on."""


def _moving_average(values: Sequence[float], window: int) -> List[float]:
    out, acc = [], 0.0
    q: List[float] = []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def summarize(records: List[Dict[str, Any]], summary: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The summary numbers (pure: records -> dict)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    events = [r for r in records if r.get("kind") == "event"]
    if not train:
        raise ReportError("metrics.jsonl has no training steps")
    skip = min(len(train) - 1, max(1, len(train) // 20))  # leave out warm-up steps (first ~5 %)
    steady = train[skip:]
    ranks = len(train[-1].get("rank_step_time", [])) or 1
    per_rank = {}
    for key in ("step_time", "data_wait", "forward", "backward", "comm", "optimizer"):
        cols = [r.get("rank_" + key) for r in steady if r.get("rank_" + key)]
        per_rank[key] = [sum(c[i] for c in cols) / len(cols) for i in range(ranks)] if cols else []
    tput = [r["samples_per_s"] for r in steady if r.get("samples_per_s")]
    out: Dict[str, Any] = {
        "steps": train[-1]["step"],
        "epochs": train[-1].get("epoch", 0) + 1,
        "ranks": ranks,
        "final_loss": train[-1].get("loss"),
        "mean_samples_per_s": sum(tput) / len(tput) if tput else None,
        "mean_step_time": (sum(r.get("step_time", 0.0) for r in steady) / len(steady)),
        "per_rank": per_rank,
        "train_time": train[-1].get("time"),
        "stragglers": sorted({e["rank"] for e in events if e.get("what") == "straggler"}),
        "nan_events": sum(1 for e in events if str(e.get("what", "")).startswith("nan")),
        "rebalances": [e.get("weights") for e in events if e.get("what") == "rebalance"],
        "ranks_lost": [e for e in events if e.get("what") == "ranks_lost"],
        "status": None,
    }
    if evals:
        last = evals[-1]
        out["test_accuracy"] = last.get("test_accuracy")
        out["test_loss"] = last.get("test_loss")
        accs = [e["test_accuracy"] for e in evals if e.get("test_accuracy") is not None]
        out["best_test_accuracy"] = max(accs) if accs else None
    if summary:
        res = summary.get("result", {})
        out["status"] = res.get("status")
        out["checkpoint"] = res.get("checkpoint")
        out["wall_s"] = res.get("wall_s")
    comm_share = None
    if per_rank.get("step_time"):
        st = sum(per_rank["step_time"])
        comm_share = sum(per_rank["comm"]) / st if st else None
    out["comm_share"] = comm_share
    return out


def render_summary(s: Dict[str, Any], run_dir: str) -> str:
    def f(v: Any, fmt: str = "{:.4f}") -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    lines = [
        f"run: {run_dir}",
        f"status: {s.get('status') or 'unknown'}; {s['steps']} steps, {s['epochs']} epoch(s), {s['ranks']} rank(s)",
        f"final training loss: {f(s['final_loss'])}",
    ]
    if "test_accuracy" in s:
        lines.append(f"test accuracy: {f(s.get('test_accuracy'))} (best {f(s.get('best_test_accuracy'))}), "
                     f"test loss: {f(s.get('test_loss'))}")
    lines.append(f"throughput: {f(s['mean_samples_per_s'], '{:.0f}')} samples/s; "
                 f"step time {f(s['mean_step_time'] * 1e3, '{:.2f}')} ms"
                 + (f", communication {100 * s['comm_share']:.0f}% of it" if s.get("comm_share") is not None else ""))
    pr = s["per_rank"]
    if pr.get("step_time"):
        for r in range(s["ranks"]):
            lines.append(f"  rank {r}: step {pr['step_time'][r] * 1e3:.2f} ms = data {pr['data_wait'][r] * 1e3:.2f}"
                         f" + forward {pr['forward'][r] * 1e3:.2f} + backward {pr['backward'][r] * 1e3:.2f}"
                         f" + comm {pr['comm'][r] * 1e3:.2f} + optimizer {pr['optimizer'][r] * 1e3:.2f} ms")
    lines.append("stragglers: " + (", ".join(f"rank {r}" for r in s["stragglers"]) or "none detected"))
    if s["rebalances"]:
        lines.append(f"data re-balanced {len(s['rebalances'])} time(s); last weights {s['rebalances'][-1]}")
    if s["nan_events"]:
        lines.append(f"non-finite loss events: {s['nan_events']}")
    for e in s.get("ranks_lost", []):
        lines.append(f"lost rank(s) {', '.join(map(str, e.get('lost', [])))} in step {e.get('step')}: "
                     f"{e.get('ranks_before')} -> {e.get('ranks')} ranks, resumed from step {e.get('resumed_step')}")
    if s.get("checkpoint"):
        lines.append(f"last checkpoint: {s['checkpoint']}")
    if s.get("wall_s") is not None:
        lines.append(f"wall time of the training command: {s['wall_s']:.1f} s")
    return "\n".join(lines) + "\n"


def _figure(size):
    """A figure of its own (matplotlib.figure.Figure on the Agg canvas): no pyplot, so the
    caller's backend, figure list and rcParams stay as they were."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _plot_loss(train: List[Dict[str, Any]], evals: List[Dict[str, Any]], s: Dict[str, Any], path: Path) -> Path:
    steps = [r["step"] for r in train]
    fig, ax = _figure((9, 5.4))
    ax.plot(steps, [r["loss"] for r in train], color="tab:blue", alpha=0.35, lw=1, label="training loss (per step)")
    ax.plot(steps, _moving_average([r["loss"] for r in train], max(1, len(train) // 50)), color="tab:blue", lw=2,
            label="training loss (moving average)")
    if evals and any(e.get("test_loss") is not None for e in evals):
        ax.plot([e["step"] for e in evals], [e.get("test_loss") for e in evals], "o-", color="tab:orange", lw=2,
                label="test loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    handles, labels = ax.get_legend_handles_labels()
    title = "Loss"
    if evals and any(e.get("test_accuracy") is not None for e in evals):
        ax2 = ax.twinx()
        ax2.grid(False)
        ax2.plot([e["step"] for e in evals], [e.get("test_accuracy") for e in evals], "s-", color="tab:green", lw=2,
                 label="test accuracy")
        ax2.set_ylabel("test accuracy", color="tab:green")
        ax2.set_ylim(0, 1.02)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        acc = s.get("test_accuracy")
        title = f"Loss and accuracy — final test accuracy {acc:.3f}" if acc is not None else "Loss and accuracy"
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(handles), fontsize=9,
              frameon=False)
    ax.set_title(title)
    return _save(fig, path)


def _plot_throughput(train: List[Dict[str, Any]], s: Dict[str, Any], path: Path) -> Path:
    steps = [r["step"] for r in train]
    fig, ax = _figure((9, 4.5))
    tput = [r.get("samples_per_s") or 0.0 for r in train]
    ax.plot(steps, tput, color="tab:purple", alpha=0.35, lw=1, label="per step")
    ax.plot(steps, _moving_average(tput, max(1, len(train) // 50)), color="tab:purple", lw=2, label="moving average")
    if s["mean_samples_per_s"]:
        ax.axhline(s["mean_samples_per_s"], color="k", ls="--", lw=1,
                   label=f"mean {s['mean_samples_per_s']:.0f} samples/s")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("samples / s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput on {s['ranks']} rank(s)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=9, frameon=False)
    return _save(fig, path)


def _plot_compute_comm(s: Dict[str, Any], path: Path) -> Path:
    pr = s["per_rank"]
    fig, ax = _figure((max(6, 1.2 * s["ranks"] + 4), 4.8))
    parts = [("data_wait", "data wait", "tab:gray"), ("forward", "forward", "tab:blue"),
             ("backward", "backward", "tab:cyan"), ("comm", "communication", "tab:red"),
             ("optimizer", "optimizer", "tab:olive")]
    ranks = list(range(s["ranks"]))
    bottom = [0.0] * len(ranks)
    for key, label, color in parts:
        vals = [v * 1e3 for v in pr[key]]
        ax.bar([str(r) for r in ranks], vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("rank")
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title("Where each rank's step time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _plot_rank_step_time(train: List[Dict[str, Any]], s: Dict[str, Any], path: Path) -> Path:
    steps = [r["step"] for r in train]
    fig, ax = _figure((9, 4.5))
    window = max(1, len(train) // 50)
    for r in range(s["ranks"]):
        series = [rec["rank_step_time"][r] * 1e3 for rec in train if len(rec.get("rank_step_time", [])) > r]
        busy = [(rec["rank_step_time"][r] - rec["rank_comm"][r]) * 1e3 for rec in train
                if len(rec.get("rank_step_time", [])) > r]
        line, = ax.plot(steps[:len(series)], _moving_average(series, window), lw=2, label=f"rank {r} step")
        ax.plot(steps[:len(busy)], _moving_average(busy, window), lw=1, ls="--", color=line.get_color(),
                label=f"rank {r} busy (step - comm)")
    for r in s["stragglers"]:
        ax.annotate(f"straggler: rank {r}", xy=(0.02, 0.92 - 0.07 * r), xycoords="axes fraction", color="tab:red")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"ms (moving average of {window})")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-rank step time")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return _save(fig, path)


def _plot_resources(train: List[Dict[str, Any]], s: Dict[str, Any], path: Path) -> Optional[Path]:
    """Per-rank CPU utilisation and resident memory (and GPU utilisation and memory where
    measured) from the background monitor's samples; None when the run has none."""
    panels = [(f, label) for f, label in (("cpu_percent", "CPU %"), ("rss_mb", "RSS (MiB)"),
                                          ("gpu_util", "GPU %"), ("gpu_mem_mb", "GPU memory (MiB)"))
              if any(v >= 0 for rec in train for v in rec.get("rank_" + f, []))]
    if not any(f == "cpu_percent" for f, _ in panels):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 2.6 * len(panels)))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0])
    steps = [r["step"] for r in train]
    for ax, (field, label) in zip(axes, panels):
        for r in range(s["ranks"]):
            series = [rec["rank_" + field][r] for rec in train if len(rec.get("rank_" + field, [])) > r]
            ax.plot(steps[:len(series)], series, lw=1.5, label=f"rank {r}")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[0].set_title("Resources per rank (background samples)")
    axes[-1].set_xlabel("optimizer step")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return _save(fig, path)


def _plot_confusion(evals: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    """The last evaluation's confusion matrix (``eval.metrics: [confusion_matrix]``)."""
    last = next((e for e in reversed(evals) if e.get("test_confusion_matrix")), None)
    if last is None:
        return None
    cm = last["test_confusion_matrix"]
    n = len(cm)
    fig, ax = _figure((1.2 + 0.5 * n, 1.0 + 0.5 * n))
    image = ax.imshow(cm, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    top = max(max(row) for row in cm) or 1
    for i in range(n):
        for j in range(n):
            ax.text(j, i, str(cm[i][j]), ha="center", va="center", fontsize=8,
                    color="white" if cm[i][j] > top / 2 else "black")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.grid(False)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"Confusion matrix at step {last['step']}")
    return _save(fig, path)


def make_report(run_dir: Path, out_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Write the PNGs and summary.txt; return ``{"summary": dict, "text": str, "files": [paths]}``.

    Needs matplotlib (``pip install 'hpctrain[report]'``); leaves matplotlib's global state
    (backend, rcParams, pyplot's figures) as it found it."""
    matplotlib = require("matplotlib", "hpctrain report (the plots of a run)")
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl here; expected the run_dir of an `hpctrain train` run\n"
                          "HINT: pass the directory printed as 'run directory:' at the end of training")
    records = read_metrics(metrics_path)
    summary_json = None
    if (run_dir / "summary.json").is_file():
        try:
            summary_json = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            summary_json = None
    s = summarize(records, summary_json)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    with matplotlib.rc_context({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3}):
        files = [_plot_loss(train, evals, s, out / "loss.png"), _plot_throughput(train, s, out / "throughput.png")]
        if s["per_rank"].get("step_time"):
            files.append(_plot_compute_comm(s, out / "compute_comm.png"))
            files.append(_plot_rank_step_time(train, s, out / "rank_step_time.png"))
        for extra in (_plot_resources(train, s, out / "resources.png"), _plot_confusion(evals, out / "confusion.png")):
            if extra is not None:
                files.append(extra)
    text = render_summary(s, str(run_dir))
    (out / "summary.txt").write_text(text)
    files.append(out / "summary.txt")
    return {"summary": s, "text": text, "files": [str(p) for p in files]}

"""A run's learning curves: the training curve PNG and the engine tau measured at snapshots.

The curve is plotted against supervised tokens, not steps, so legs with other batch
sizes and data sets line up; engine tau points (`tau_curve.jsonl`, written by an
evaluation run over the weight snapshots, e.g. benchmarks/snapshot_tau.py) are drawn
beside the trainer's own held-out estimate, with their log-linear trend.
"""

import json
from pathlib import Path
from typing import Dict, List, Optional


def read_tau_curve(path):
    """Engine tau measured at weight snapshots (written by an evaluation run), sorted by tokens."""
    path = Path(path)
    if not path.exists():
        return None
    pts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(pts, key=lambda p: p["tokens"]) or None


def plot_curves(state: Dict, path, tau_points: Optional[List[Dict]] = None):
    """Training curve PNG: loss/accuracy vs supervised tokens, held-out tau estimate
    (and engine-measured tau where given; the deep held-out records where evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash_mlx.train.evaluate import tau_trend

    hist, evals = state.get("history", []), state.get("evals", [])
    trend = tau_trend(tau_points or [], min_tokens=200_000)
    fig, axes = plt.subplots(1, 4 if trend else 3, figsize=(20 if trend else 15, 4))
    if hist:
        t = [h["tokens"] for h in hist]
        axes[0].plot(t, [h["loss"] for h in hist], label="train", alpha=0.6)
        axes[1].plot(t, [h["acc"] for h in hist], label="train", alpha=0.6)
        axes[2].plot(t, [h["tau_hat"] for h in hist], label="train tau (estimate)", alpha=0.5)
    if evals:
        t = [e["tokens"] for e in evals]
        axes[0].plot(t, [e["val_loss"] for e in evals], "o-", label="held-out")
        axes[1].plot(t, [e["val_acc"] for e in evals], "o-", label="held-out")
        axes[2].plot(t, [e["val_tau_hat"] for e in evals], "o-", label="held-out tau (estimate)")
        deep = [e for e in evals if e.get("depth")]
        if deep:  # held-out deep records (--depth-data), another distribution: plotted apart
            t = [e["tokens"] for e in deep]
            for ax, key in zip(axes, ("val_loss", "val_acc", "val_tau_hat")):
                ax.plot(t, [e["depth"][key] for e in deep], "s--", label="held-out, deep")
        # The first steps' losses (tens of nats) would flatten the rest of the curve.
        top = 1.5 * max([e["val_loss"] for e in evals] + [e["depth"]["val_loss"] for e in deep])
        if top > 0:  # a held-out set with no label to score gives loss 0
            axes[0].set_ylim(0, top)
    if tau_points:
        axes[2].plot([p["tokens"] for p in tau_points], [p["tau"] for p in tau_points], "s-",
                     label="engine tau (greedy, B=16)")
    if trend:
        import numpy as np

        ax = axes[3]
        pts = [p for p in tau_points if p["tokens"] > 0]
        ax.semilogx([p["tokens"] for p in pts], [p["tau"] for p in pts], "s", base=2, label="engine tau")
        x = np.logspace(np.log2(pts[0]["tokens"]), np.log2(pts[-1]["tokens"]) + 7, 50, base=2)
        ax.plot(x, trend["intercept"] + trend["per_doubling"] * np.log2(x), "--",
                label=f"fit: {trend['per_doubling']:+.3f} tau per doubling")
        ax.axvline(pts[-1]["tokens"], color="grey", alpha=0.4)
    titles = ["weighted CE loss", "top-1 accuracy (mask positions)", "tau",
              "engine tau, log-linear trend (extrapolated 128x)"]
    drawn = [[ln.get_label() for ln in ax.get_lines()] for ax in axes]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("supervised tokens")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn  # the curves' labels, per panel

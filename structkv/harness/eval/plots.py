"""Plots of an evaluation folder: accuracy vs KV budget, per-task bars, needle heatmaps."""
from __future__ import annotations

from pathlib import Path

from .. import pyplot


def plot_all(result: dict, records: list[dict], out: Path) -> list[str]:
    """Write the plots into `out`; returns their file names."""
    plt = pyplot()
    rows = result["rows"]
    written = []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        # Accuracy vs KV budget: one line per method; the full cache as a horizontal reference.
        # With a single budget a line plot says nothing: bars of the average per method instead.
        fig, ax = plt.subplots(figsize=(6, 4))
        budgets = sorted({r["kv_budget"] for r in at if r["kv_budget"] is not None})
        if len(budgets) > 1:
            markers = "os^vD<>pP*X"
            # Equal memory means equal kept bytes (hybrid models' propagation empties sliding rings),
            # so the x axis is the kept KV MiB where the records have it, else the budget asked for.
            kept = all(r.get("kv_bytes_kept") is not None for r in at)
            x = (lambda r: r["kv_bytes_kept"] / 2**20) if kept else (lambda r: r["kv_budget"])
            for j, run in enumerate(sorted({r["run"] for r in at if r["kv_budget"] is not None})):
                pts = sorted((x(r), r["average"]) for r in at if r["run"] == run)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[j % len(markers)], label=run)
            for r in at:
                if r["kv_budget"] is None:
                    ax.axhline(r["average"], color="black", linestyle="--", label=r["run"])
            ax.set(xlabel="KV kept (MiB, mean per prompt)" if kept else "KV budget (fraction of the prompt)",
                   ylabel="average score", title=f"{length} tokens")
            ax.legend(fontsize=7)
        else:
            ordered = sorted(at, key=lambda r: (r["kv_budget"] is not None, -r["average"]))
            ax.barh([r["label"] for r in ordered][::-1], [r["average"] for r in ordered][::-1],
                    color=["black" if r["kv_budget"] is None else "tab:blue" for r in ordered][::-1])
            title = f"{length} tokens, R_KV {budgets[0]:g}" if budgets else f"{length} tokens"
            ax.set(xlabel="average score", title=title)
        name = f"accuracy_vs_budget_{length}.png"
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)
        # Per-task bars, one group per task, one bar per method run.
        tasks = sorted({t for r in at for t in r["tasks"]})
        fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 0.9), 4))
        width = 0.8 / len(at)
        for i, r in enumerate(at):
            ax.bar([t + i * width for t in range(len(tasks))], [r["tasks"].get(t, 0) for t in tasks], width,
                   label=r["label"])
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, rotation=45, ha="right", fontsize=7)
        ax.set(ylabel="score", title=f"per task, {length} tokens")
        ax.legend(fontsize=6, ncol=2)
        name = f"tasks_{length}.png"
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)
    needles = [r for r in records if r.get("depth") is not None]
    if needles:
        written += _heatmaps(plt, needles, out)
    return written


def _heatmaps(plt, records: list[dict], out: Path) -> list[str]:
    """Needle score per (depth, length) cell, one panel per method run."""
    labels = sorted({r["label"] for r in records})
    depths = sorted({r["depth"] for r in records})
    lengths = sorted({r["length_budget"] for r in records})
    fig, axes = plt.subplots(1, len(labels), figsize=(2.2 * len(labels) + 1, 3), squeeze=False)
    for ax, label in zip(axes[0], labels):
        grid = [[0.0] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                cell = [r["score"] for r in records
                        if r["label"] == label and r["depth"] == d and r["length_budget"] == n]
                grid[i][j] = 100 * sum(cell) / len(cell) if cell else float("nan")
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(label, fontsize=8)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    name = "needle_heatmap.png"
    fig.savefig(out / name, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [name]

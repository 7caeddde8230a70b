"""The PNG chart of a run: stall and time until committed per workload and system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmark.common import GiB


def render_png(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = res["workloads"]
    names = list(dict.fromkeys(n for w in wl for n in w["systems"]))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 2.4 * len(wl) + 5), 10))
    width = 0.8 / (len(names) + 1)
    cmap = plt.get_cmap("tab20")
    for ax, (key, limkey, title, limname, color) in zip(
        axes,
        (
            ("stall_s", "memcpy_s", "stall per save (training thread blocked)", "memcpy (limit)", "black"),
            (
                "committed_s",
                "raw_write_fsync_s",
                "time until committed (durable)",
                "raw write+fsync (limit)",
                "dimgray",
            ),
        ),
    ):
        xs = range(len(wl))
        ax.bar(
            [x - 0.4 + width / 2 for x in xs],
            [w["limits"][limkey] * 1e3 for w in wl],
            width,
            color=color,
            hatch="//" if color != "black" else None,
            label=limname,
        )
        for j, n in enumerate(names):
            vals = [w["systems"][n][key] * 1e3 if n in w["systems"] else 0 for w in wl]
            ax.bar([x - 0.4 + width * (j + 1.5) for x in xs], vals, width, color=cmap(j % 20), label=n)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(title)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [
                f"{w['name']}\n"
                + (f"{w['bytes'] / GiB:.2f} GiB" if w["bytes"] >= GiB // 4 else f"{w['bytes'] / 1e6:.1f} MB")
                for w in wl
            ]
        )
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    h1, l1 = axes[1].get_legend_handles_labels()
    handles, labels = [h1[0]] + handles, [l1[0]] + labels
    fig.legend(handles, labels, fontsize=8, ncol=4, loc="lower center", frameon=False)
    m = res["machine"]
    fig.suptitle(f"Checkpoint saves: medians after the first save ({m['cpu_count']} CPUs, torch {m['torch']})")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

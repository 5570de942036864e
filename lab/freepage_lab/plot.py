"""PNG plots (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():  # imported lazily: matplotlib is slow to import and optional for tests
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_plot(path: Path, t_s: list[float], mib: list[float], marks: list[float],
                  title: str, series: dict[str, tuple[list[float], list[float]]] | None = None) -> None:
    """Footprint over time; vertical lines where the guest freed its memory."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if series:
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.legend()
    else:
        ax.plot(t_s, mib, linewidth=1.2)
    for m in marks:
        ax.axvline(m, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("time since guest start (s)")
    ax.set_ylabel("host footprint (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_plot(path: Path, groups: dict[str, dict[str, float]], ylabel: str, title: str) -> None:
    """Grouped bars: groups[group][variant] = value."""
    plt = _pyplot()
    variants = sorted({v for g in groups.values() for v in g})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(variants), 1)
    for j, v in enumerate(variants):
        xs = [i + j * width for i in range(len(groups))]
        ax.bar(xs, [groups[g].get(v, 0.0) for g in groups], width, label=v)
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels(list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_plot(path: Path, series: dict[str, tuple[list[float], list[float], list[float],
                                                     list[float]]],
                 xlabel: str, ylabel: str, title: str) -> None:
    """A line per series over a log2 x axis and a log y axis (costs that
    grow by orders of magnitude): series[label] = (x, median, low, high),
    the band from low to high shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (xs, ys, lo, hi) in series.items():
        ax.plot(xs, ys, marker="o", label=label, linewidth=1.2)
        ax.fill_between(xs, lo, hi, alpha=0.2)
    ax.set_xscale("log", base=2)
    xs_all = sorted({x for xs, _, _, _ in series.values() for x in xs})
    ax.set_xticks(xs_all)
    ax.set_xticklabels([f"{x:g}" for x in xs_all])
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

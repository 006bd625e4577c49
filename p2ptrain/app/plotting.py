"""Loss plots of the demos (matplotlib, from the ``plot`` extra, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from p2ptrain.errors import MissingDependencyError

__all__ = ["plot_series"]


def plot_series(
    path: Path,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    ylabel: str,
    marks: Sequence[float] = (),
) -> Path | None:
    """Write a PNG of ``(label, [(x, y), ...])`` lines; ``None`` if every series is empty.

    ``marks`` are x positions drawn as dotted vertical lines (e.g. a late join).

    Raises:
        MissingDependencyError: matplotlib (the ``plot`` extra) is not installed.
    """
    if not any(points for _, points in series):
        return None
    try:
        import matplotlib  # noqa: PLC0415 - slow import
    except ImportError as exc:
        raise MissingDependencyError(
            "skipped: matplotlib is not installed (pip install 'p2ptrain[plot]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for label, points in series:
        if points:
            axes.plot([x for x, _ in points], [y for _, y in points], label=label)
    for x in marks:
        axes.axvline(x, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("seconds since the demo started")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(ncol=2 if len(series) > 4 else 1, fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path

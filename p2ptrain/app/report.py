"""What the demos show: text tables, loss series from peers' events, and loss plots.

matplotlib (the ``plot`` extra) is imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from p2ptrain.errors import MissingDependencyError

__all__ = ["losses_of", "plot_series", "text_table"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns under a dashed rule."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def losses_of(events: Iterable[dict[str, Any]], kind: str) -> list[tuple[float, float]]:
    """(``t``, ``loss``) of the events of ``kind`` that carry a loss."""
    return [
        (float(e["t"]), float(e["loss"]))
        for e in events
        if e.get("event") == kind and isinstance(e.get("loss"), int | float)
    ]


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

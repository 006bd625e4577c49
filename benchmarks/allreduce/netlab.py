"""The star lab of shaped links: now :mod:`p2ptrain.lab.starlab` (the demo uses it too)."""

from p2ptrain.lab.starlab import LinkSpec, StarLab, unavailable_reason

__all__ = ["LinkSpec", "StarLab", "unavailable_reason"]

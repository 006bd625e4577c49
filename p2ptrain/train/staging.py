"""Moving a trainer's flat vector between the parameters' device and the network.

The network (the all-reduce) reads and writes host memory. A trainer whose
parameters live on an accelerator accumulates on that device, then copies
the vector to average into a pinned host buffer with a non-blocking copy
and waits for that copy only (not for the whole device); the average comes
back to the device with a non-blocking copy. On the CPU nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2ptrain.errors import ConfigError

__all__ = ["HostStaging", "parameters_device"]


def parameters_device(params: Sequence[torch.Tensor]) -> torch.device:
    """The one device all ``params`` live on.

    Raises:
        ConfigError: They live on several devices.
    """
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ConfigError(f"the parameters live on several devices: {sorted(map(str, devices))}")
    return devices.pop()


class HostStaging:
    """A pinned host buffer for one flat float32 vector of ``numel`` elements on ``device``.

    Args:
        numel: Elements of the vector.
        device: Where the vector lives.
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        if device.type != "cpu":
            pin = torch.cuda.is_available() if device.type == "cuda" else False
            self._host = torch.empty(numel, dtype=torch.float32, pin_memory=pin)

    def to_host(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector`` in host memory (itself on the CPU; else the staging buffer, filled).

        The buffer is reused by the next call: the caller is done with the
        previous result by then (one average at a time).
        """
        host = self._host
        if host is None or vector.device.type == "cpu":
            return vector
        host.copy_(vector, non_blocking=True)
        if vector.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(vector.device))
            event.synchronize()  # only this copy, not the whole device
        else:
            _synchronize(vector.device.type)
        return host

    def settle(self) -> None:
        """Wait for the non-blocking copies :meth:`to_device` queued (no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        elif self.device.type != "cpu":
            _synchronize(self.device.type)

    def to_device(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``value`` (host memory) as a tensor on ``like``'s device with its dtype."""
        return value.to(device=like.device, dtype=like.dtype, non_blocking=True)


def _synchronize(device_type: str) -> None:
    """Wait for everything queued on a device type other than CUDA (e.g. ``mps``), if torch can."""
    synchronize = getattr(getattr(torch, device_type, None), "synchronize", None)
    if callable(synchronize):
        synchronize()

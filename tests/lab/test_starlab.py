"""The star lab of shaped links: its delay shims and re-shaping (network namespaces, root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.lab.natlab.native_shim import SHIM_ENV, _build, native_shim
from p2ptrain.lab.starlab import LinkSpec, StarLab
from p2ptrain.testing.natlab_plugin import require_netns

_CLIENT = """
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], 9000), timeout=10)
rtts = []
for _ in range(5):
    t = time.monotonic(); s.sendall(b"x"); s.recv(1); rtts.append(time.monotonic() - t)
t = time.monotonic(); s.sendall(b"y" * int(sys.argv[2])); s.shutdown(socket.SHUT_WR); s.recv(1)
print(json.dumps({"rtt": min(rtts), "bulk_s": time.monotonic() - t}))
"""
_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen(); c, _ = s.accept()
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    if d == b"x":
        c.sendall(b"x")
c.sendall(b"z")
"""


def _exchange(lab: StarLab, nbytes: int) -> dict[str, float]:
    server = subprocess.Popen(lab.argv(1, [sys.executable, "-c", _SERVER]))
    try:
        for _ in range(50):  # the server binds in its own process: retry the connect
            done = subprocess.run(
                lab.argv(0, [sys.executable, "-c", _CLIENT, lab.host_address(1), str(nbytes)]),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if done.returncode == 0:
                result: dict[str, float] = json.loads(done.stdout)
                return result
        raise AssertionError(done.stderr)
    finally:
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("shim", ["compiled", "python"])
def test_delay_shims_set_the_round_trip_and_links_can_be_reshaped(
    shim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_netns()
    if shim == "python":
        monkeypatch.setenv(SHIM_ENV, "python")
    elif native_shim() is None:
        pytest.skip("no C compiler: the labs run the Python shim")
    with StarLab([LinkSpec(100, 100), LinkSpec(100, 100)], delay_ms=15) as lab:
        python_shims = ["lossy_link" in " ".join(argv) for argv in lab.shim_argvs()]
        assert python_shims == [shim == "python"] * 2
        first = _exchange(lab, 2_000_000)
        assert 0.029 <= first["rtt"] < 0.1  # 2 × 15 ms, plus the shims' scheduling
        lab.set_link(1, LinkSpec(10, 10))  # its download now 10 Mbit/s
        assert lab.links[1] == LinkSpec(10, 10)
        second = _exchange(lab, 2_000_000)
        # 2 MB at 10 Mbit/s takes at least 1.6 s; at 100 Mbit/s it took far less.
        assert second["bulk_s"] >= 1.5 > first["bulk_s"]


def test_the_shim_is_python_when_asked_or_when_it_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHIM_ENV, "python")
    assert native_shim() is None
    monkeypatch.delenv(SHIM_ENV)
    not_a_directory = tmp_path / "cache"
    not_a_directory.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_directory))
    _build.cache_clear()
    try:
        assert native_shim() is None  # no cache directory to build into: the Python shim
    finally:
        _build.cache_clear()

"""How long after ``--seconds`` a ``p2ptrain train`` peer ends.

    python -m benchmarks.bench_stop [--trials 3] [--seconds 8,11]

A real ``p2ptrain bootstrap`` and, per trial, one ``p2ptrain train`` peer per
value of ``--seconds`` (8 and 11 by default), all in one run: the first to
stop leaves its partner waiting for a group that will not form, the last one
trains on alone. For each peer it prints how long after its ``--seconds``
(counted from its first progress event, i.e. when training began) its
summary (``end`` event) came and its process exited. The last line is one
JSON object with every overrun and the largest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", *args]


def _join_address(boot: subprocess.Popen[str]) -> str:
    assert boot.stdout is not None
    for line in boot.stdout:
        if "--join" in line:
            return line.split("--join", 1)[1].strip()
    raise RuntimeError("the bootstrap peer printed no --join address")


def _overrun(process: subprocess.Popen[str], seconds: float) -> dict[str, Any]:
    assert process.stdout is not None
    began = ended = None
    for line in process.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "progress" and began is None:
            began = event["time"] - event["elapsed"]
        if event.get("event") == "end":
            ended = time.time()
    process.wait()
    exited = time.time()
    if began is None or ended is None:
        raise RuntimeError(
            f"the peer (--seconds {seconds}) never trained (exit {process.returncode})"
        )
    return {
        "seconds": seconds,
        "summary_after_s": ended - began - seconds,
        "exit_after_s": exited - began - seconds,
        "exit_code": process.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--trials", type=int, default=3, help="runs of the peers")
    parser.add_argument("--seconds", default="8,11", help="each peer's --seconds, comma-separated")
    args = parser.parse_args(argv)
    durations = [float(s) for s in args.seconds.split(",")]
    boot = subprocess.Popen(_command("bootstrap", "--port", "0"), stdout=subprocess.PIPE, text=True)
    rows: list[dict[str, Any]] = []
    try:
        address = _join_address(boot)
        for trial in range(args.trials):
            peers = [
                (
                    seconds,
                    subprocess.Popen(
                        _command(
                            "train",
                            "--join",
                            address,
                            "--run-id",
                            f"stop-{trial}",
                            "--seconds",
                            str(seconds),
                            "--log-json",
                            "-",
                            "--torch-threads",
                            "1",
                        ),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    ),
                )
                for seconds in durations
            ]
            for seconds, process in peers:
                row = {"trial": trial, **_overrun(process, seconds)}
                rows.append(row)
    finally:
        boot.terminate()
        boot.wait(15)
    print(f"{'trial':>5} {'--seconds':>9} {'summary after':>14} {'exit after':>11} {'code':>5}")
    for row in rows:
        print(
            f"{row['trial']:5d} {row['seconds']:9.1f} {row['summary_after_s']:13.2f}s"
            f" {row['exit_after_s']:10.2f}s {row['exit_code']:5d}"
        )
    worst = max(row["exit_after_s"] for row in rows)
    print(f"largest exit after --seconds: {worst:.2f} s")
    print(json.dumps({"stop": {"rows": rows, "max_exit_after_s": worst}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The parts of ``bench_transport``: the paths it measures (RPC and a raw socket)."""

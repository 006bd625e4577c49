"""The helpers of ``bench_allreduce``: worker processes, the shaped lab, systems, reports."""

"""Worker threads for a pipeline's torch compute.

``torch.set_num_threads`` sets the calling thread's OpenMP team size only: a
thread started later (a ``ThreadPoolExecutor`` worker) runs its operators
with a team as large as the machine's cores. A stage server that computes in
a worker thread of a process set to one thread then ran two threads per
operator, and on two cores shared by five processes their spinning teams cost
more than the work: 8.5 ms instead of 0.13 ms for a forward of two width-128
blocks on 8 samples, and several times the compute at width 2048
(``benchmarks/bench_pipeline.py`` part (a)). :func:`compute_pool` starts its
workers with the thread count of the thread that made the pool.
"""

from __future__ import annotations

import concurrent.futures

import torch

__all__ = ["compute_pool"]


def compute_pool(name: str, *, workers: int = 1) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose workers use the caller's ``torch.get_num_threads()``.

    Args:
        name: The workers' thread-name prefix.
        workers: How many worker threads.
    """
    threads = torch.get_num_threads()
    return concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(threads,)
    )

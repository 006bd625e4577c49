"""The benchmarks of p2ptrain: one module per benchmark (``bench_NAME.py``) and a shared harness.

Run one from the repository root as a module::

    python -m benchmarks.bench_transport --help

or through the command line, ``p2ptrain bench transport --help`` (from a
source checkout). Each prints side-by-side tables and, as its last line, one
JSON object; :mod:`benchmarks.harness` holds what they share (child
processes, event loops from :mod:`p2ptrain.aio`, statistics, tables, plots).
A benchmark of one module is ``bench_NAME.py``; one with helper modules
keeps them in a sub-package (``allreduce/`` for ``bench_allreduce``,
``training_wan/`` for ``bench_training --wan``).
"""

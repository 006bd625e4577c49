"""The benchmarks of p2ptrain, laid out by one rule.

* A benchmark ``NAME`` is the module ``bench_NAME.py``: its command line,
  its tables and its last line of JSON. Run it from the repository root as
  ``python -m benchmarks.bench_NAME`` or ``p2ptrain bench NAME`` (from a
  source checkout).
* The modules that only it uses (child processes, a competitor's peer, a
  lab runner) live in the sub-package ``NAME/``: ``allreduce/``,
  ``pipeline/``, ``training/`` (``bench_training --wan``). A ``bench_*.py``
  grown past ~600 lines moves parts there, not into a new folder.
* Every benchmark is listed in :mod:`benchmarks.registry`, which
  ``p2ptrain bench`` and ``bench_all`` read; a test fails when a
  ``bench_*.py`` or a sub-package is not listed there.
* What several share is in three modules: :mod:`benchmarks.harness` (child
  processes, event loops from :mod:`p2ptrain.aio`, statistics, tables,
  plots), :mod:`benchmarks.options` (the flags several take) and the
  registry. Timings that tests share with benchmarks are in
  :mod:`p2ptrain.lab.timings`.
"""

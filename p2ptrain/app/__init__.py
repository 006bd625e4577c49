"""The command-line application on top of every layer: ``p2ptrain ...``.

* :mod:`~p2ptrain.app.cli`: the argument parser and the commands' entry points.
* :mod:`~p2ptrain.app.train`: ``p2ptrain train``, one training peer.
* :mod:`~p2ptrain.app.demo`: ``p2ptrain demo``, a local swarm of processes.
* :mod:`~p2ptrain.app.task`: loading the model and data a peer trains.

Nothing below this package imports it.
"""

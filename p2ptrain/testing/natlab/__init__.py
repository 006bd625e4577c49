"""The NAT lab: homes behind real NATs in Linux network namespaces.

* :mod:`~p2ptrain.testing.natlab.lab`: :class:`NatLab`, the lab itself.
* :mod:`~p2ptrain.testing.natlab.config`: its configuration.
* :mod:`~p2ptrain.testing.natlab.netns`: namespaces, veths, iptables.
* :mod:`~p2ptrain.testing.natlab.shim`: the delay/loss shim.
* :mod:`~p2ptrain.testing.natlab.turn`: coturn.
* :mod:`~p2ptrain.testing.natlab.plugin`: the pytest fixture and skips.
* :mod:`~p2ptrain.testing.natlab.cli`: ``python -m p2ptrain.testing.natlab.cli``.

See docs/nat-lab.md.
"""

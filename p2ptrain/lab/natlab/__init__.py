"""The NAT lab: homes behind real NATs in Linux network namespaces.

* :mod:`~p2ptrain.lab.natlab.lab`: :class:`NatLab`, the lab itself.
* :mod:`~p2ptrain.lab.natlab.config`: its configuration.
* :mod:`~p2ptrain.lab.natlab.netns`: namespaces, veths, iptables.
* :mod:`~p2ptrain.lab.natlab.shim`: the delay/loss shim.
* :mod:`~p2ptrain.lab.natlab.turn`: coturn.
* :mod:`~p2ptrain.lab.natlab.cli`: ``python -m p2ptrain.lab.natlab.cli``.

The pytest fixture and skips live with the test doubles, in ``natlab_plugin``.

See docs/nat-lab.md.
"""

"""Labs that users run: the NAT lab, the star lab, the simulated network and the simulators.

Product-grade tools, importable by the application (``p2ptrain demo --shaped``,
``p2ptrain natlab``, the benchmarks): Linux network namespaces with real NATs
and shaped links (:mod:`~p2ptrain.lab.natlab`, :mod:`~p2ptrain.lab.starlab`),
a user-space delay and loss shim (:mod:`~p2ptrain.lab.lossy_link`), and many
peers of the production classes in one process over a simulated network on a
virtual clock (:mod:`~p2ptrain.lab.simnet`, :mod:`~p2ptrain.lab.virtual_clock`,
:mod:`~p2ptrain.lab.simulator`, :mod:`~p2ptrain.lab.swarm_sim`), and the
matchmaking and progress timings that tests and benchmarks share for peers
on one machine (:mod:`~p2ptrain.lab.timings`).
Test doubles and conformance suites live in the package's ``testing`` folder,
which nothing in the package imports.
"""

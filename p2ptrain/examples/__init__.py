"""Examples that ship with the package (so an installed ``p2ptrain`` can run them).

:mod:`p2ptrain.examples.charlm` is the default task of ``p2ptrain train`` and
``p2ptrain demo``: a character-level transformer on the King James Bible,
whose text (972 KB compressed) is package data.
"""

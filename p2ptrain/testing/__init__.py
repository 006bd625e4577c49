"""Helpers shared by p2ptrain's tests and by users testing their own parts."""

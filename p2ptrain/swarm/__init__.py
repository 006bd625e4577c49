"""SWARM pipeline training (placeholder until the core package lands)."""

"""p2ptrain: train one PyTorch model together over the internet."""

__version__ = "0.1.0"

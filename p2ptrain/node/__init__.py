"""A peer on the network: listener, connection pool and RPC handlers."""

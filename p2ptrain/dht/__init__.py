"""p2ptrain.dht"""

"""p2ptrain.nat"""

"""p2ptrain.transport"""

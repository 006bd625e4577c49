"""p2ptrain.wire"""

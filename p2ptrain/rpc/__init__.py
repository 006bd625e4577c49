"""p2ptrain.rpc"""

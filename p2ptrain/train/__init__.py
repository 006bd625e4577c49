"""p2ptrain.train"""

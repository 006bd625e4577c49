"""p2ptrain.allreduce"""

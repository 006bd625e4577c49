"""The helpers of ``bench_pipeline``: the model, torch.distributed.pipelining
workers and p2ptrain pipeline peers."""

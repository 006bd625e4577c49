"""The helpers of ``bench_training --wan``: peers over shaped links, ours and hivemind's."""

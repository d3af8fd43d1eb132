"""Profiling the workers' steps: the per-rank window (step_profiler) and its summaries.

Nothing on the serving path imports this package: a worker loads it only when
NANOPIPE_PROFILE_DIR is set (protocol.profile_settings, gpu_workers.worker_proc.served_by),
and the benchmark tool reads the summaries.
"""

"""Kept for older imports: the launcher lives in emergency_ckpt.launcher."""

from emergency_ckpt.launcher import JobResult, free_port, run_job

__all__ = ["JobResult", "free_port", "run_job"]

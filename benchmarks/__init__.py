"""Benchmarks of emergency_ckpt against Orbax's emergency checkpoint managers.

Run `python -m benchmarks.run --help`. Everything runs as real multi-process
jax.distributed jobs on CPU (4 processes x 2 devices), launched through
tests/mpjob.py; see benchmarks/run.py for the phases and benchmarks/report.py
for what each figure means.
"""

"""Benchmarks of emergency_ckpt against Orbax's emergency checkpoint managers.

Run `python -m emergency_ckpt.bench --help` (or `emergency-ckpt bench`).
Everything runs as real multi-process jax.distributed jobs on CPU (4 processes
x 2 devices), launched through emergency_ckpt.demo.launcher; see run.py for
the phases and figures.py for what each figure means. Recorded results of the
repository's runs are in its benchmarks/results/ folder.
"""

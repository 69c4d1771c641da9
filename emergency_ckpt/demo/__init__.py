"""The README's main job, shipped with the package: a 2-slice CPU training run
that loses a slice and resumes from its peer slice, bit-exactly.

Run it with `emergency-ckpt demo` or `python -m emergency_ckpt.demo`. main.py
drives the three jobs, trainer.py runs in every process, cpu_demo.yaml is the
checkpoint config (the same file as the repository's configs/cpu_demo.yaml).
"""

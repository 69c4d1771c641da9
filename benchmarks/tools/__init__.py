"""Small measurement tools behind some of benchmarks/results/ (run from a checkout: `python -m benchmarks.tools.<name>`)."""

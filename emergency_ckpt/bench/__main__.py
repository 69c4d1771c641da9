"""`python -m emergency_ckpt.bench`: the benchmark (see emergency_ckpt.bench.run)."""

import sys

from emergency_ckpt.bench.run import main

sys.exit(main())

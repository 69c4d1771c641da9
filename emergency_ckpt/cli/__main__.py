"""`python -m emergency_ckpt.cli`: the `emergency-ckpt` command."""

import sys

from emergency_ckpt.cli import main

sys.exit(main())

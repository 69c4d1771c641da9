"""`python -m emergency_ckpt.demo`: the README's main job (see main.py)."""

import sys

from emergency_ckpt.demo.main import main

sys.exit(main())

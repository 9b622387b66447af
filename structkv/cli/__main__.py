"""`python -m structkv.cli` (what torchrun launches)."""
import sys

from . import main

sys.exit(main())

"""`python -m leaflens ...`: the same as the `leaflens` command."""

import sys

from leaflens.pipeline.cli import main

sys.exit(main())

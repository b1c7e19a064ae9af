"""`python -m angel_jax.cli ...`: the same as `angel-jax ...` (what the huge-page restart and the tests run)."""

import sys

from angel_jax.cli.dispatch import main

sys.exit(main())

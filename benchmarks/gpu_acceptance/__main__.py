"""``python -m benchmarks.gpu_acceptance``: see ``benchmarks.gpu_acceptance``."""

import sys

from benchmarks.gpu_acceptance.main import main

sys.exit(main())

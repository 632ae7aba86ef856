"""``python -m autotune.timing.calibration [--force]``."""

import sys

from autotune.timing.calibration import main

sys.exit(main())

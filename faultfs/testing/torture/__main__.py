"""``python -m faultfs.testing.torture``: the torture suite (``scripts/torture``)."""

import sys

from faultfs.testing.torture.main import main

sys.exit(main())

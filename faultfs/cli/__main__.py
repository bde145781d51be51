"""``python -m faultfs.cli``: how ``faultfs mount`` starts its daemon."""

import sys

from faultfs.cli import main

sys.exit(main())

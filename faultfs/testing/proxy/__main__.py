"""``python -m faultfs.testing.proxy``: run a proxy from a shell (``cli``)."""

import sys

from faultfs.testing.proxy.cli import main

if __name__ == "__main__":
    sys.exit(main())

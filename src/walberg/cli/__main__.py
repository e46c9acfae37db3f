"""`python -m walberg.cli`: the command line, as the `walberg` command runs it."""

import sys

from walberg.cli import main

sys.exit(main())

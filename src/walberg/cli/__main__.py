"""`python -m walberg.cli`: the command line, as the `walberg` command runs it."""

import sys

from walberg.cli.main import main

sys.exit(main())

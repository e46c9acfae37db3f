"""The command line (``walberg``): parsing, dispatch and exit codes (main), the one output
layer (output: human tables or ``--json``) and the demo (demo). Importing the package loads
none of them: ``walberg demo`` and the other commands import only what they use."""

from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``walberg`` command (see walberg.cli.main)."""
    from walberg.cli.main import main as run

    return run(argv)

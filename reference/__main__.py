"""``python -m reference TRACE``: the reference engine's stand-alone command line."""
import sys

from reference.cli import main

sys.exit(main())

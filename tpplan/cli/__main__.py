"""`python -m tpplan.cli`: the `tpplan` command."""

import sys

from . import main

sys.exit(main())

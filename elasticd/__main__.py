"""`python -m elasticd` is the `elasticd` command."""

import sys

from elasticd.cli import main

sys.exit(main())

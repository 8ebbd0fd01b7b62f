"""`python -m pdserve` is the `pdserve` command."""

import sys

from pdserve.cli import main

sys.exit(main())

"""`python -m router` is `pgmesh`."""

from __future__ import annotations

import sys

from router.ops.cli import main

sys.exit(main())

"""``python -m aps``: the same as the ``aps`` command."""

from __future__ import annotations

import sys

from aps.cli import main

sys.exit(main())

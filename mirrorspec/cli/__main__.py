"""``python -m mirrorspec.cli``, as ``python -m mirrorspec`` and the ``mirrorspec`` command."""

import sys

from mirrorspec.cli import main

sys.exit(main())

import sys

from mirrorspec.cli import main

sys.exit(main())

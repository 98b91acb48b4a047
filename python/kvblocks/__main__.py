import sys

from kvblocks.cli import main

sys.exit(main())

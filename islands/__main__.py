import sys

from islands.cli import main

sys.exit(main())

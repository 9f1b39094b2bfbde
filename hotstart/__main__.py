import sys

from hotstart.cli import main

sys.exit(main())

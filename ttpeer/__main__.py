import sys

from ttpeer.cli import main

sys.exit(main())

import sys

from concur.cli import main

sys.exit(main())

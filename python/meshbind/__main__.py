import sys

from meshbind.cli import main

sys.exit(main())

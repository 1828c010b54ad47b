import sys

from batchline.cli import main

sys.exit(main())

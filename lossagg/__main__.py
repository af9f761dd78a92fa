import sys

from lossagg.cli import main

sys.exit(main())

import sys

from tools.images.build import main

sys.exit(main())

import sys

from offload_shim._cli import main

sys.exit(main())

"""``python -m offload_shim``: the ``offload-shim`` command, with the same behaviour (``offload_shim_boot.main``)."""

import sys

from offload_shim_boot import main

sys.exit(main())

"""``python -m offload_shim``: the ``offload-shim`` command, with the same behaviour (``offload_shim_cli.main``)."""

import sys

from offload_shim_cli import main

sys.exit(main())

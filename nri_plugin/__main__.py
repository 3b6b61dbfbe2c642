"""``python -m nri_plugin``: the same as the ``nri-qos`` command."""

import sys

from nri_plugin.cli import main

sys.exit(main())

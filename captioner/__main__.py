"""``python -m captioner``: the ``captioner`` command (``captioner.cli``)."""

import sys

from captioner.cli import main

sys.exit(main())

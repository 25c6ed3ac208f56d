"""``python -m captioner.cli``: the ``captioner`` command."""

import sys

from captioner.cli import main

sys.exit(main())

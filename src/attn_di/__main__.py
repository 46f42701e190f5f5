"""``python -m attn_di``: the ``attn-di`` command."""

import sys

from attn_di.cli import main

sys.exit(main())

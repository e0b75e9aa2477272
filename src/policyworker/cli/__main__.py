"""``python -m policyworker.cli``: the same as the ``policyworker`` command."""

import sys

from policyworker.cli import main

sys.exit(main())

"""``python -m megatron_mimesis.gpu_check``: the acceptance run (``run.main``)."""

import sys

from megatron_mimesis.gpu_check.run import main

sys.exit(main())

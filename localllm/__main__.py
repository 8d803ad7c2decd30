"""`python -m localllm` = the `localllm` command."""

import sys

from localllm.cli import main

sys.exit(main())

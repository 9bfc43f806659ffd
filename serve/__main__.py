"""`python -m serve`: the same as `textgen-serve`."""

import sys

from serve.cli import main

sys.exit(main())

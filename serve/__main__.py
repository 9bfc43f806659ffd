"""`python -m serve`: the same as `textgen-serve`."""

import sys

from serve.api.cli import main

# Guarded: the engine process (spawned) imports the parent's main module again.
if __name__ == "__main__":
    sys.exit(main())

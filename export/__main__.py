"""`python -m export`: the same as `textgen-export`."""

from export.cli import main

raise SystemExit(main())

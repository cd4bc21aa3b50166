"""``python -m pagedserve`` runs the CLI."""

from pagedserve.cli import main

raise SystemExit(main())

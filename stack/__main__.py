"""``python -m stack`` runs the ``pagedserve`` CLI (the module form of the console script)."""

from stack.cli import main

raise SystemExit(main())

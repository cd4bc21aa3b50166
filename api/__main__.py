"""``python -m api``: same as ``pagedserve api``."""

from api.server import main

raise SystemExit(main())

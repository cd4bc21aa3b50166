"""``python -m pagedserve`` is not the CLI's module form any more: the CLI lives in the
application layer (:mod:`stack`), which the contract package must not import. Say where it is."""

import sys

sys.stderr.write("the CLI is the `pagedserve` command, or `python -m stack`\n")
raise SystemExit(2)

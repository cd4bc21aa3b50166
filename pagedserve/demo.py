"""``pagedserve demo`` (see :mod:`pagedserve.supervisor`)."""

from pagedserve.supervisor import demo_main as main

__all__ = ["main"]

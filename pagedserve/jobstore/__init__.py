"""The parts of :class:`pagedserve.store.JobStore` (import it from ``pagedserve.store``)."""

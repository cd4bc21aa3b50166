"""The parts of :class:`pagedserve.batches.BatchStore` (import it from ``pagedserve.batches``)."""

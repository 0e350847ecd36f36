"""FineWeb-Edu to packed, resumable token batches (filled by the data work, issue 5)."""

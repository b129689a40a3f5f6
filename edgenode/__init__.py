"""edgenode."""

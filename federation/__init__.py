"""federation."""

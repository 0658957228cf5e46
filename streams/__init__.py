"""streams."""

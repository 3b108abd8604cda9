"""Random lowerings (filled in below)."""

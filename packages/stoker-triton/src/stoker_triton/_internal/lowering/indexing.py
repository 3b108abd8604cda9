"""Indexing lowerings (filled in below)."""

"""Placeholder: hypothesis strategies for every state (being written)."""

"""Hypothesis property and stateful tests (run with HYPOTHESIS_PROFILE=ci|dev|soak)."""

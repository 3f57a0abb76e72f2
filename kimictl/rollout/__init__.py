"""Rollout: change a running P/D deployment slice by slice (see run.py)."""

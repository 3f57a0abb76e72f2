"""Checkpoint staging: manifest, pull, all-gather, verify; fake hub for tests and the sandbox."""

"""Checkpoint staging: manifest, pull, all-gather, verify (the fake hub and checkpoint generator: kimictl/sandbox/)."""

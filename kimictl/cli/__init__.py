"""Command-line layer: parses arguments and prints; logic lives in the stage modules."""

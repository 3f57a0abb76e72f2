"""`python -m kimictl`."""

from kimictl.cli.main import main

main()

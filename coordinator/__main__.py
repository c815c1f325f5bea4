"""`python -m coordinator` is `soma-coord`."""

from coordinator.cli import main

main()

"""`python -m kvstate`: the command line (`kvstate.cli`)."""

from kvstate.cli import main

main()

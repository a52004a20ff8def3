"""`python -m fleetc`: the fleetc command line."""
import sys

from fleetc.cli import main

if __name__ == "__main__":
    sys.exit(main())

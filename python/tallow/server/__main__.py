"""`python -m tallow.server [MODEL] [flags]`: the same as `tallow serve`."""
import sys

from tallow.server.cli import main

if __name__ == "__main__":
    sys.exit(main())

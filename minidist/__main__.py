"""``python -m minidist COMMAND [options]``: see :mod:`minidist.cli`."""
import sys

from minidist.cli import main

if __name__ == "__main__":
    sys.exit(main())

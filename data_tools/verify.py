#!/usr/bin/env python3
"""`python data_tools/verify.py ...` = `hpctrain data verify ...` (see `--help`)."""
import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module
# for everything imported below: take the folder off sys.path, put the repository on it.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))

from hpctrain.cli.data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))

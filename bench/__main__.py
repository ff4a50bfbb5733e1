"""python -m rdmasock.bench: the suite (bench/__init__.py)."""
import sys

from .cli import main

sys.exit(main())

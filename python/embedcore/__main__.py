import sys

from .cli import run_as_program

sys.exit(run_as_program())

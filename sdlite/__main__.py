from .cli import run
import sys
sys.exit(run())

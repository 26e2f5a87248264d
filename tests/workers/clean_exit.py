"""How a worker leaves once its work is done, as train.py's main() does: flushed, then os._exit, with no
interpreter teardown (in it, gloo's threads can abort a finished rank: SIGABRT)."""

import os
import sys


def leave(code: int = 0) -> None:
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)

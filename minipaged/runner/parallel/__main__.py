"""A tensor-parallel worker process: `python -m minipaged.runner.parallel FD`.

Rank 0 starts one per worker rank (`minipaged.runner.parallel.worker.start_worker`); FD is the
worker's end of the socket pair to rank 0, over which its `RankSpec` arrives and then every
step's plan. A fresh interpreter that imports only minipaged: the caller's main module (a script,
standard input, a notebook) is never imported here.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from minipaged.runner.parallel.worker import worker_main


def main(argv: list[str]) -> int:
    """Run the worker on descriptor `argv[0]`; 2 for a wrong command line."""
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m minipaged.runner.parallel FD (started by a tensor-parallel engine)",
              file=sys.stderr)
        return 2
    worker_main(Connection(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

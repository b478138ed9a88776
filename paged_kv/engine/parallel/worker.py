"""``python -m paged_kv.engine.parallel.worker RANK WORLD_SIZE INIT_METHOD TIMEOUT``: one
tensor-parallel worker, as `TensorParallelGroup` starts it (see `group.worker_main`)."""

import sys

from .group import worker_main

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))

"""TensorFlow worker for the benchmarks (started by _common.TFWorker).

TensorFlow's thread counts must be set before it initializes, so each thread
count gets its own process. It loads the weights into a tf.Variable and the
id sets into SparseTensors, then answers commands on stdin, one per line;
answers go to stdout prefixed "@@" (TensorFlow may print on stdout too):

    run <set>            one tf.function call of safe_embedding_lookup_sparse
                         (sum), output fetched with .numpy(); -> seconds
    dump <set> <path>    saves the output (.npy)
    quit
"""
import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--bag", type=int, required=True)
    ap.add_argument("--ids", action="append", default=[], help="name=path of int64 ids")
    args = ap.parse_args()

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    w = np.fromfile(args.weights, dtype=np.float32).reshape(args.rows, args.dim)
    table = tf.Variable(w, trainable=False)
    del w

    b, bag = args.batch, args.bag
    index = np.stack([np.repeat(np.arange(b), bag), np.tile(np.arange(bag), b)], 1).astype(np.int64)
    sparse = {}
    for spec in args.ids:
        name, path = spec.split("=", 1)
        ids = np.fromfile(path, dtype=np.int64)
        sparse[name] = tf.SparseTensor(tf.constant(index), tf.constant(ids), [b, bag])

    @tf.function
    def lookup(sp):
        return tf.nn.safe_embedding_lookup_sparse(table, sp, None, combiner="sum")

    for sp in sparse.values():  # trace and warm once
        lookup(sp).numpy()

    def say(x):
        sys.stdout.write(f"@@ {x}\n")
        sys.stdout.flush()

    say("ready")
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "run":
            sp = sparse[parts[1]]
            t0 = time.perf_counter()
            lookup(sp).numpy()
            say(f"{time.perf_counter() - t0:.9f}")
        elif parts[0] == "dump":
            np.save(parts[2], lookup(sparse[parts[1]]).numpy())
            say("ok")
        elif parts[0] == "quit":
            break
        else:
            say("error")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""row_splits -> row_ids on the GPU: the binary search against the merge-path load-balancing search.

    python benchmarks/ragged_search.py [--out-dtype int32|int64] [--smoke]

For num_elems in (10^6, 10^7, 10^8) and num_rows in (16, 1000, 10000) (the transducer's layout: up
to 10^8 rows of logits in up to 10^4 utterances), random row sizes summing to num_elems, about a
tenth of the rows empty. Each method's time is the median of 10 replays of a CUDA graph of `calls`
back-to-back calls of ragged.row_splits_to_row_ids (no host overhead in the timing), divided by
`calls`; GB/s counts the row_ids written. The two methods' row_ids are compared once per case.
--smoke runs tiny sizes, to check that the script works. Prints a table; writes nothing.
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ragged  # noqa: E402
from ragged.ragged_cuda import DEFAULT_METHOD  # noqa: E402

NUM_ELEMS = (10**6, 10**7, 10**8)
NUM_ROWS = (16, 1000, 10000)
REPLAYS, WARMUP = 10, 3


def random_row_splits(rng, num_rows, num_elems, device):
    """int64 row_splits of num_rows random sizes summing to num_elems, about 10% of the rows empty."""
    sizes = np.zeros(num_rows, dtype=np.int64)
    full = np.flatnonzero(rng.random(num_rows) >= 0.1)
    if full.size == 0:
        full = np.arange(num_rows)
    sizes[full] = rng.multinomial(num_elems, np.full(full.size, 1.0 / full.size))
    return torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])).to(device)


def time_us(rs, num_elems, dtype, method, calls):
    """Median GPU time of one call, in microseconds."""

    def run():
        for _ in range(calls):
            ragged.row_splits_to_row_ids(rs, num_elems, dtype=dtype, method=method)

    stream = torch.cuda.Stream()  # warm up (compile) off the default stream, as graph capture asks
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(WARMUP):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dtype", choices=("int32", "int64"), default="int32")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that the script runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ragged_search.py needs a CUDA GPU")
    dtype = getattr(torch, args.out_dtype)
    num_elems_list, num_rows_list = ((10**4,), (16, 1000)) if args.smoke else (NUM_ELEMS, NUM_ROWS)
    methods = ragged.ROW_IDS_METHODS
    rng = np.random.default_rng(0)
    print(
        f"row_splits (int64) -> row_ids ({args.out_dtype}) on {torch.cuda.get_device_name()}; "
        f"median of {REPLAYS} graph replays; default method: {DEFAULT_METHOD}"
    )
    header = f"{'num_elems':>10} {'num_rows':>8}"
    for m in methods:
        header += f" {m + ' us':>17} {'GB/s':>7}"
    print(header + "  faster")
    for num_elems in num_elems_list:
        calls = max(1, min(100, 10**8 // num_elems))
        for num_rows in num_rows_list:
            rs = random_row_splits(rng, num_rows, num_elems, "cuda")
            ids = [ragged.row_splits_to_row_ids(rs, num_elems, dtype=dtype, method=m) for m in methods]
            if not all(torch.equal(ids[0], other) for other in ids[1:]):
                sys.exit(f"the methods disagree at num_elems={num_elems}, num_rows={num_rows}")
            del ids
            line = f"{num_elems:>10} {num_rows:>8}"
            times = {}
            for m in methods:
                times[m] = time_us(rs, num_elems, dtype, m, calls)
                gbs = num_elems * dtype.itemsize / (times[m] * 1e-6) / 1e9
                line += f" {times[m]:>17.1f} {gbs:>7.0f}"
            fastest = min(times, key=times.get)
            slowest = max(times, key=times.get)
            print(f"{line}  {fastest} ({times[slowest] / times[fastest]:.2f}x)")


if __name__ == "__main__":
    main()

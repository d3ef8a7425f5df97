"""torch.load of a training state the size of shardwright's checkpoint bench (for
scripts/bench-restore.sh): `world` rank files of `tensors` fp32 tensors of `elems` each,
written once with torch.save, then loaded `reps` times (every file, in rank order, as one
restore); prints one JSON line with the median seconds of a restore, plain and with
`mmap=True` (its tensors touched once, so the bytes are read), and the first plain
restore's (fresh memory, as a restarted job's).

Usage: bench_torch_load.py DIR WORLD TENSORS ELEMS [REPS]
"""

import json
import os
import statistics
import sys
import time

import torch


def main():
    d, world, tensors, elems = sys.argv[1], *map(int, sys.argv[2:5])
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    paths = []
    for r in range(world):
        state = {f"layers.{t}.weight": torch.randn(elems, generator=g) for t in range(tensors)}
        p = os.path.join(d, f"rank{r:05d}.pt")
        torch.save({"model": state, "meta": {"step": 1, "rng": [1, 2, 3]}}, p)
        paths.append(p)
    nbytes = world * tensors * elems * 4

    def restore(mmap):
        t = time.perf_counter()
        for p in paths:
            s = torch.load(p, weights_only=True, mmap=mmap)
            if mmap:
                for x in s["model"].values():
                    x.sum()
        return time.perf_counter() - t

    # The first load runs on memory the process never had (as a restarted job's does);
    # later ones reuse what the allocator kept from the one before.
    first = restore(False)
    plain = statistics.median([first] + [restore(False) for _ in range(reps - 1)])
    mapped = statistics.median(restore(True) for _ in range(reps))
    for p in paths:
        os.remove(p)
    print(json.dumps({"torch": torch.__version__, "bytes": nbytes,
                      "torch_load_first_s": first, "torch_load_s": plain,
                      "torch_load_mmap_s": mapped}))


if __name__ == "__main__":
    main()

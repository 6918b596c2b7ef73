"""What packing token ids costs: `gateway.store.arrays.encode_ids` (struct) against `array("i", ids).tobytes()`.

Every record's ids are packed once, on the event loop, for its write-ahead log line (gateway.recorder.spool_lines);
the writer stores those bytes in its row. That is on the hot path of every call, on prompts of up to tens of thousands
of ids. Prints ns an id for each way at several lengths and their ratio, measured in one run.

    .venv/bin/python bench/pack_ids.py [--lengths 16 71 3000 30000]
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from array import array
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.store.arrays import encode_ids  # noqa: E402


def ns_per_id(pack: Callable[[list[int]], bytes | None], ids: list[int]) -> float:
    """The best of 7 repeats, each packing `ids` about 2 M ids' worth of times."""
    number = max(1, 2_000_000 // len(ids))
    return min(timeit.repeat(lambda: pack(ids), number=number, repeat=7)) / number / len(ids) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 71, 3000, 30000])
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{'ids':>7}  {'encode_ids ns/id':>16}  {'array ns/id':>11}  {'ratio':>5}")
    for length in args.lengths:
        ids = [rng.randrange(0, 152_064) for _ in range(length)]  # a Qwen-sized vocabulary
        assert encode_ids(ids) == array("i", ids).tobytes()
        ours = ns_per_id(encode_ids, ids)
        theirs = ns_per_id(lambda values: array("i", values).tobytes(), ids)
        print(f"{length:>7}  {ours:>16.1f}  {theirs:>11.1f}  {ours / theirs:>5.2f}")


if __name__ == "__main__":
    main()

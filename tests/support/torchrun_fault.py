"""`trajgate` under torchrun with one rank dying mid-step, for tests/e2e/test_torchrun_e2e.py.

The rank named by TRAJGATE_TEST_KILL_RANK exits (status 3, no clean-up, as a crashed or OOM-killed process
would) after its share of the step's backward passes, just before the gradients are summed over the ranks.
The fault lives here, not in the trainer: production code has no hook to kill itself.
"""

from __future__ import annotations

import os
import sys

from gateway.cli import main
from trainer.distributed import DataParallel

if os.environ["RANK"] == os.environ["TRAJGATE_TEST_KILL_RANK"]:

    def _die(*_: object) -> None:
        os._exit(3)

    DataParallel.reduce_gradients = _die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())

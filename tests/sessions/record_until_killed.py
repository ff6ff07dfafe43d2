"""Kill-test subprocess: record a never-ending workload; print each step's live snapshot digest
and the recorder's committed-step count. The test kills it with SIGKILL.

    python record_until_killed.py MODEL_DIR SESSION_PATH
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session_testutil import drive, make_engine, snapshot_digest  # noqa: E402

from kvscope.sessions import Recorder  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model_dir, path = sys.argv[1], sys.argv[2]
    engine = make_engine(model_dir)
    rec = Recorder(path, engine, keyframe_every=10, flush_interval_s=0.05,
                   raw_hashes=True).start()  # the digests are of the live hashes

    def on_step(e):
        print(f"digest {e.num_steps - 1} {snapshot_digest(e.snapshot())}", flush=True)
        print(f"written {rec.status().steps_written}", flush=True)

    drive(engine, on_step=on_step, forever=True)


if __name__ == "__main__":
    main()

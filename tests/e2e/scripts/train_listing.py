"""The bundled tiny trainer, preceded by what a training script sees when it starts.

It prints the checkpoint directory's listing before anything else, so a test
can tell that the sidecar's restore was there before the trainer ran (the
trainer never sees an empty directory when a valid checkpoint exists).
"""

import json
import os
import sys

from local.demo.train_tiny import main

LISTING_PREFIX = "start listing: "

if __name__ == "__main__":
    checkpoints = os.path.join(os.environ.get("JITCKPT_DIR", "/nonexistent"), "checkpoints")
    listing = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else None
    print(LISTING_PREFIX + json.dumps(listing), flush=True)
    sys.exit(main())

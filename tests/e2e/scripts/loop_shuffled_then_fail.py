"""The loop of ``loop_shuffled.py``, then a check after the save that fails.

The model is saved, and the program then ends with ``sys.exit`` and a
message (status 1): a run that failed must not publish a final model.
"""

import sys

from loop_shuffled import main

if __name__ == "__main__":
    main()
    sys.exit("the accuracy check after training failed")

"""The same fine-tuning as ``train_save_model.py``, then a step after the save that fails.

A user script whose evaluation (or upload, or anything after training)
raises once the model is saved: the process exits with status 1, and a run
that failed must not publish a final model.
"""

from train_save_model import main

if __name__ == "__main__":
    main()
    raise RuntimeError("the evaluation after training failed")

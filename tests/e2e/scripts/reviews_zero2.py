"""``reviews_zero.py`` under DeepSpeed ZeRO-2: optimizer state and gradients partitioned,
every rank's weights whole, so ``save_model()`` writes the model itself.

    torchrun --nproc-per-node 2 reviews_zero2.py
"""

from reviews_zero import main

if __name__ == "__main__":
    main(stage=2)

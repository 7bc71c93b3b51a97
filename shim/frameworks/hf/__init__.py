"""transformers' ``Trainer`` (TRL and every subclass): ``trainer`` hooks the step and
the save, ``saves`` writes periodic checkpoints in the background, ``data`` keeps the
train loader's place."""

"""PyTorch Lightning (``lightning.pytorch`` and ``pytorch_lightning``): ``trainer`` patches
``Trainer.fit`` and the connectors, ``saves`` writes in the background, ``data`` is the
train loader's resumable place, ``exact`` remakes a resumed epoch's iterator and stands
down for train data that cannot resume exactly, ``memory`` is the metric state
Lightning's checkpoint leaves out, ``sharded`` is ``ModelParallelStrategy``'s own
distributed checkpoint."""

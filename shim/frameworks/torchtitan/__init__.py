"""torchtitan (``python -m torchtitan.train``, its ``Trainer``): ``trainer`` patches
``Trainer.train`` (the step end, the resume, the normal end), ``manager`` saves, stages
and loads through torchtitan's own ``CheckpointManager``."""

"""One folder per training framework the shim follows, over the shared core in ``shim/``.

The core (``activate``, ``trainrun``, ``channel``, ``protocol``, ``asyncsave``,
``dataloaders``...) knows the run: the SIGTERM agreement, staging, the sidecar and
the exact data path. Each framework's folder knows only where that framework's
step boundary, save and resume are: ``hf`` (transformers' ``Trainer`` and every
subclass), ``lightning`` (PyTorch Lightning), ``torchtitan`` (its ``Trainer``),
``plain`` (a plain PyTorch loop, Accelerate's included), ``fabric`` (which
Lightning Fabric setups ``plain`` serves). ``activate`` imports one only after
the user's program imported its framework.
"""

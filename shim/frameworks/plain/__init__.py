"""A plain PyTorch loop, Accelerate's included: ``loop`` follows the optimizer step (the
step boundary, the save and resume points), ``state`` is the ``loop-state/`` format,
``created`` the objects in creation order, ``extrastate``, ``fingerprint`` and
``programstate`` the state beside the training modules (an EMA, scalers, the program's
own objects), ``shardedstate`` and ``shardedsaves`` an FSDP2 module's state through
``torch.distributed.checkpoint`` (JIT and periodic)."""

"""A plain loop's checkpoint on disk: what it holds, where each part is written, and how a
rank reads it back.

``state`` is the ``loop-state/`` format (the objects, in creation order, and the
rank files), with ``extrastate`` and ``fingerprint`` choosing the state beside
the training modules; ``replicated`` writes a DDP loop's one copy as shares
spread over the ranks; ``shardedstate`` and ``shardedsaves`` an FSDP2 module's
state through ``torch.distributed.checkpoint`` (JIT and periodic);
``nodelocal`` says which files only their node's ranks read; ``reshard`` maps
a checkpoint onto another number of processes; ``saved`` is the read side a
resume begins with. Where the program stands is not here (``place``), nor when
a checkpoint is taken (``loop``).
"""

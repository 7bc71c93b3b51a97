"""A plain PyTorch loop, Accelerate's and Lightning Fabric's included, in three parts.

- Following the loop: ``loop`` (the optimizer step is the step boundary, the
  checks that leave a loop alone) and the components it hands off to,
  ``resume`` (from the restored checkpoint to the resume point), ``save``
  (the JIT checkpoint at the save point, periodic ones) and ``stop`` (a loop
  left alone, SIGTERM with no save coming, the normal end); ``nooptimizer``
  a process that trains with no optimizer's step.
- ``place``: where the program stands (its stack of loops, their iterators,
  the variables they changed): captured, put back, or said why not.
- ``layout``: what a checkpoint holds and where it is written (the
  ``loop-state/`` rank files, the replicated shares, an FSDP2 module's DCP
  files, which files are node-local), and how a rank reads it back, on
  another number of processes too.

Beside them, what both use: ``created`` (the objects in creation order) and
``programstate`` (which code, classes and objects are the program's own).
"""

"""DeepSpeed's engine in a loop of the program's own (``deepspeed.initialize``, or
Accelerate's ``DeepSpeedPlugin``): its state saved and loaded by the engine itself.

The plain loop (``frameworks/plain``) follows such a loop as any other: the step
boundary, the agreed stop, the data position, random states and the loop's own
variables. What it cannot save with ``torch.save`` is the engine's: ZeRO
partitions the optimizer's state (stage 1), its gradients (2) and the
parameters themselves (3) across ranks, and keeps fp32 master weights the
modules do not hold. ``engines`` has the engine's own ``save_checkpoint`` write
them (every rank its partitions) and its own ``load_checkpoint`` read them back.
HF's Trainer under DeepSpeed is ``frameworks/hf``'s (through HF's own save).
"""

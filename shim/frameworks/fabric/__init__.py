"""Lightning Fabric (``lightning.fabric``, ``lightning_fabric``): its loops are the program's
own, followed by ``plain`` like any plain loop (Fabric's wrapped module, optimizer and
loader, its ``DistributedSampler``, its precision plugins); ``strategies`` says which of
Fabric's strategies that covers, and names the others once."""

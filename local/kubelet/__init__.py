"""The local pod runner as a node's kubelet: the API server's pods, run on this machine.

``Kubelet`` registers a Node (one process per simulated node), keeps its Lease
renewed, watches the pods the scheduler binds to it and runs each one exactly as
``local.podrunner`` runs a pod (PID namespace, native sidecars, preStop, grace
period, termination messages), with the Secrets, ConfigMaps and service-account
token the API server gives that pod. It reports the pod's status back (phase,
conditions, container states, exit codes, termination messages) and honors
graceful deletion: a deletionTimestamp starts termination with the grace period
the deletion carries, and the pod object is removed once its containers are gone.
Only what the API server admitted and bound to the node ever runs here.
"""

from local.kubelet.agent import Kubelet

__all__ = ["Kubelet"]

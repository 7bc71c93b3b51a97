"""``jitckpt demo --cluster``: the demo's preemption on a real control plane.

Where ``local/demo`` plays the controllers' part itself (it makes the pods a
PyTorchJob's operator would and sends them SIGTERM), this runs the parts
themselves on 127.0.0.1: kube-apiserver with its controllers and scheduler,
two nodes run by ``local/kubelet``, Kueue, the Kubeflow training-operator and
jitckpt's webhook installed from deploy/ (``cluster.py``); then Kueue preempts
a low-priority PyTorchJob for a high-priority one and admits it again, and the
resumed job's weights are compared bitwise with an uninterrupted run's
(``flow.py``). Needs the binaries of ``make controlplane`` and root (the pod
runner's namespaces, the controllers' private mounts).
"""

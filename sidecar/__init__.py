"""The checkpoint sidecar (``jitckpt agent``) and ``jitckpt ls``.

One module per job:

- ``config``: settings from the injected env; ``uri``: job roots (s3://, pvc://, a path)
- ``storage``: the async store interface, the S3 (aiobotocore) and directory backends
- ``checksum``: CRC32C; ``manifest``: ``node-<k>.json``; ``commit``: upload + manifest last
- ``validity``: DESIGN 7's rule; ``restore``: newest valid checkpoint, verified
- ``staging``: ownership of staged dirs, recovery after a restart, file modes across uids
- ``uploader``: the LIFO queue with JIT first; ``retention``: keep the newest N valid
- ``server``: the shim's Unix socket; ``status``: /healthz, /readyz, /status, /metrics
- ``grace``: the grace clock and the "too short" estimate; ``state``/``metrics``: what
  /status and /metrics show; ``termination``: the termination message; ``events``: Events
- ``shimcopy``: the shim into the trainer's PYTHONPATH volume; ``agent``: the lifecycle
"""

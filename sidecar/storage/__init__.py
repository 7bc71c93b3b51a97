"""Checkpoint stores: one async interface, an S3 and a mounted-claim backend."""

from __future__ import annotations

from sidecar.storage.base import ObjectInfo, Store, StoreError, VerificationError

__all__ = ["ObjectInfo", "Store", "StoreError", "VerificationError"]

"""The admission server's collector setting: what is alive once the app is built is frozen."""

from __future__ import annotations

import gc

from webhook import gcpause
from webhook.config import WebhookConfig
from webhook.server import create_app


def test_settle_freezes_the_built_app_out_of_every_collection() -> None:
    app = create_app(WebhookConfig(), None)
    try:
        gcpause.settle()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # The app's objects are no longer in any generation a collection walks.
        assert not any(
            item is app for generation in range(3) for item in gc.get_objects(generation)
        )
    finally:
        gc.unfreeze()

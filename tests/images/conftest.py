"""The images ``make images-check`` built: tests here read them, never the source tree.

``make test`` builds them first and names their directory in ``JITCKPT_IMAGES``
(``<dir>/webhook`` and ``<dir>/sidecar``, each an OCI layout and its root). A
plain ``pytest`` without that variable skips these tests, saying how to run them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from local.podrunner.image import ImageRoot
from tests.images.support import ENV_IMAGES


def _exports() -> Path:
    where = os.environ.get(ENV_IMAGES)
    if not where:
        pytest.skip(f"no built images: `make images-check`, then {ENV_IMAGES}=build/images")
    return Path(where)


@pytest.fixture(scope="session")
def webhook_image() -> ImageRoot:
    return ImageRoot.load(_exports() / "webhook")


@pytest.fixture(scope="session")
def sidecar_image() -> ImageRoot:
    return ImageRoot.load(_exports() / "sidecar")

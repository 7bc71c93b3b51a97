"""Build both images with buildah, from a Python base made of Debian's packages.

``python -m tools.images`` (``make images-check``): no daemon, no registry. See
``build.py`` for the steps and docs/platform/install.md, "Images", for when to use it.
"""

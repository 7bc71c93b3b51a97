"""Developer tools that are not part of the product (no image and no wheel ships them)."""

"""The docs site's generated pages: read from the code at every build, so they cannot drift.

``hook.py`` is the MkDocs hook (``mkdocs.yml``) that adds them to the site;
each other module renders one page from where its facts are defined (the
settings from ``webhook/settings.py`` and ``webhook/config.py``, the messages
from the shim's and the sidecar's call sites, the metrics from their
``prometheus_client`` definitions, the compatibility matrix from its YAML and
``constraints.txt``). What the code cannot say (what a message means, what to
do about it) is written by hand in a YAML file beside each page's module,
keyed by what the code defines; ``tests/docs`` fails when a key has no entry
or an entry names nothing the code still defines.
"""

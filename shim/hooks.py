"""Post-import hooks: run a function right after a named module has executed.

The shim must not import torch or transformers itself (a plain ``python -c``
would pay seconds for it), so it waits for the user's program to import them.
A meta path finder sees each import once; for the few names registered here it
wraps the real loader's ``exec_module`` and calls the hook after it. For every
other name it returns None at the cost of one dict lookup. A spec found without
an import (``importlib.util.find_spec("torch")``, which ``datasets`` and
``transformers`` ask before they import torch) keeps the hooks waiting: they run
when a module is executed, once.
"""

from __future__ import annotations

import sys

from .log import failed

# ``typing`` costs milliseconds at startup of every Python process in the
# container; annotations are strings here, so only the type checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any, Callable, Dict, List, Optional, Sequence

    Hook = Callable[[ModuleType], None]


class _HookedLoader:
    """Delegates to the real loader, then runs the hooks still waiting for the module."""

    def __init__(self, loader: Any, finder: "PostImportFinder") -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first: reloads and pickling see the original.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        for hook in self._finder.take(module.__name__):
            try:
                hook(module)
            except Exception as exc:
                failed("hook for %s" % module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder:
    """A meta path finder that only ever answers for the registered module names."""

    def __init__(self) -> None:
        self._hooks: Dict[str, List[Hook]] = {}
        self._busy: set[str] = set()

    def register(self, name: str, hook: Hook) -> None:
        """Run ``hook(module)`` after ``name`` is imported (at once if it already is)."""
        module = sys.modules.get(name)
        if module is not None:
            try:
                hook(module)
            except Exception as exc:
                failed("hook for %s" % name, exc)
            return
        self._hooks.setdefault(name, []).append(hook)

    def take(self, name: str) -> List[Hook]:
        """The hooks waiting for ``name``, now due (each runs once)."""
        return self._hooks.pop(name, [])

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None
    ) -> Any:
        hooks = self._hooks.get(fullname)
        if hooks is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = _find_with_others(self, fullname, path, target)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, self)
        return spec


def _find_with_others(
    me: PostImportFinder, fullname: str, path: Optional[Sequence[str]], target: Any
) -> Any:
    for finder in sys.meta_path:
        if finder is me:
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


_FINDER = PostImportFinder()


def when_imported(name: str, hook: Hook) -> None:
    """Register a post-import hook, installing the finder on first use."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.register(name, hook)

"""Run a callback once a module has been imported, without importing it ourselves.

The vLLM plugin runs in every vLLM process (API server, engine core, worker). Patching
`vllm.v1.worker.cpu_worker` by importing it would cost the API server ~0.9 s and ~26 MiB
(measured) for a class it never uses, and importing vLLM modules from inside plugin loading
risks import cycles. So patches wait for the module: if it is already imported the callback
runs now, otherwise a meta-path finder wraps the module's loader and runs the callback right
after the module body has executed, before the importer sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_LOG = logging.getLogger("vllm.spark_edge.post_import")

Callback = Callable[[ModuleType], None]

_pending: dict[str, list[Callback]] = {}
_lock = threading.Lock()
_searching = threading.local()  # guards against finders that re-enter the import system


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` now if `name` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, [callback])
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())


def pending() -> list[str]:
    """Modules that still have callbacks waiting (for tests and diagnostics)."""
    with _lock:
        return sorted(_pending)


def _run(name: str, module: ModuleType, callbacks: list[Callback]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # a broken patch must never break vLLM's import
            _LOG.exception(
                "spark-edge: patching %s with %s failed; vLLM runs unpatched there",
                name,
                getattr(callback, "__name__", callback),
            )


def _fire(module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(module.__name__, [])
    _run(module.__name__, module, callbacks)


class _NotifyingLoader(importlib.abc.Loader):
    """The module's own loader, plus the callbacks once the module body has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _fire(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_resource_reader, is_package...: linecache and importlib.resources need them
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, then wraps the loader of watched modules."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            watched = fullname in _pending
        if not watched or getattr(_searching, "name", None) == fullname:
            return None
        _searching.name = fullname
        try:
            spec = self._find_with_others(fullname, path, target)
        finally:
            _searching.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing we can wrap: the callbacks stay pending
        spec.loader = _NotifyingLoader(spec.loader)
        return spec

    def _find_with_others(
        self, fullname: str, path: Any, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

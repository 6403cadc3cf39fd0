"""Triton's interpreter, which runs the engine's kernels on the CPU in these tests, without its slowest habit.

NOTE: Triton 3.9's interpreter re-patches the language module (every ``tl`` builtin, each found by
``inspect.getmembers``) at every call of a ``@triton.jit`` helper from inside a kernel, although the kernel's
launch has patched the same modules and the patches stay until the launch ends. A kernel that calls a helper
once a tile spent about a third of its time there (tests/engine/test_engine.py's split decodes: 24.8 s, 14.3 s
without). ``skip_repeated_patches`` lets such a call through without patching when every language module its
helper sees is patched already; a helper that sees another (``tl.zeros`` sees ``triton.language.core``) is
patched as before. The kernels run the same numpy operations either way."""

from __future__ import annotations

import inspect


def skip_repeated_patches() -> None:
    """Wrap ``triton.runtime.interpreter._patch_lang`` (left as it is where this Triton has none)."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "skips_repeats", False):
        return
    patched: set[int] = set()  # ids of the language modules the running launch has patched
    langs_seen_by: dict[object, set[int]] = {}  # a kernel's or helper's function: the language modules it sees
    launches = []  # the running launch's scope (launches do not nest)

    class NothingPatched:
        def restore(self) -> None:
            pass

    def end_launch(restore_patches) -> None:
        launches.clear()
        patched.clear()
        restore_patches()

    def patch_once_a_launch(fn):
        langs = langs_seen_by.get(fn)
        if langs is None:
            langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
            langs_seen_by[fn] = langs
        if launches and langs <= patched:
            return NothingPatched()
        scope = patch_lang(fn)
        patched.update(langs)
        if not launches:  # a kernel's launch: its scope restores everything when the grid is done
            launches.append(scope)
            restore_patches = scope.restore
            scope.restore = lambda: end_launch(restore_patches)
        return scope

    patch_once_a_launch.skips_repeats = True
    interpreter._patch_lang = patch_once_a_launch

"""crate-clip: CLIPA-style contrastive pretraining with a CRATE-alpha image tower.

Importing this package makes the CRATE / CRATE-alpha towers available to timm and the CRATE-alpha CLIP model
configs to open_clip, so `timm.create_model('crate_alpha_base_patch16_224')` and
`open_clip.create_model_and_transforms('CRATE-alpha-CLIPA-L-14')` work afterwards, whichever is imported first.

The registration (crate_clip.models.registration: torch, timm and open_clip, seconds of CPU) happens when it is
needed: at once when timm or open_clip is already imported, else right after the first of them finishes importing
(a post-import hook), so `import crate_clip` alone, and every `crate-clip ... --help`, stays cheap.
"""
import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

_REGISTRY_MODULE = "crate_clip.models.registration"
_HOOKED = ("timm", "open_clip")
_importing: set = set()   # hooked modules whose own import is under way (open_clip imports timm midway)


_pending = False   # timm / open_clip finished importing while the registration could not run yet


def _crate_clip_half_imported(done: str = "") -> bool:
    """A crate_clip submodule other than `done` (whose code has just run) is still executing: one that imports
    open_clip at its top (core.image_normalization) would be imported back by the registration, a circular import."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()) if name.startswith("crate_clip.") and name != done)


def _register_when_ready(done: str = "") -> None:
    """Import crate_clip.models.registration (which registers everything) once no hooked module and no crate_clip
    submodule is half-imported; until then it is pending, and the end of each crate_clip submodule's import tries
    again."""
    global _pending
    if _REGISTRY_MODULE in sys.modules:
        _pending = False
    elif _importing or _crate_clip_half_imported(done):
        _pending = True
    else:
        _pending = False
        importlib.import_module(_REGISTRY_MODULE)


class _RegisteringLoader(importlib.abc.Loader):
    """The module's own loader, then the registration: after timm or open_clip, and after a crate_clip submodule
    while the registration is pending."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader   # the module's own loader for its resources and reloads
        module.__spec__.loader = self._loader
        hooked = self._name in _HOOKED
        if hooked:
            _importing.add(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            _importing.discard(self._name)
        if hooked or _pending:
            _register_when_ready(done=self._name)

    def __getattr__(self, attr):   # get_filename, is_package, get_resource_reader, ...
        return getattr(self._loader, attr)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds timm, open_clip and crate_clip's submodules with the other finders and wraps their loader."""

    def find_spec(self, name, path=None, target=None):
        if name not in _HOOKED and not name.startswith("crate_clip."):
            return None
        if _REGISTRY_MODULE in sys.modules:   # registered: nothing left to wait for, imports go on unwrapped
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader, name)
                return spec
        return None


def _install() -> None:
    if any(name in sys.modules for name in _HOOKED):
        _register_when_ready()
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def __getattr__(name: str):
    """`crate_clip.models` (and its registration) on first use; `crate_clip.create_clip`, the one front door for
    models (crate_clip.models.clip_factory), from it."""
    if name == "models":
        return importlib.import_module("crate_clip.models")
    if name == "create_clip":
        return importlib.import_module("crate_clip.models").create_clip
    raise AttributeError(f"module 'crate_clip' has no attribute {name!r}")


_install()

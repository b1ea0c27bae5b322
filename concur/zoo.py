"""Build the models named on the command line, and the input size each is made for.

A model spec is ``torchvision:NAME`` (``torchvision.models.list_models()``),
``timm:NAME`` (``timm.list_models()``, needs ``pip install timm``) or
``package.module:factory`` (a callable taking no arguments), imported as
``python -m`` would: a module in the current folder is found without
``PYTHONPATH``; ``path/to/file.py:factory`` names a file, relative or absolute,
anywhere. A model file that fails to import, or a factory that raises, is a
:class:`ModelSpecError` naming the file and line. Every model is randomly initialised: concur's plan depends on
shapes, not on weights.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

__all__ = ["ModelSpecError", "ZooModel", "load", "build_model", "import_from_cwd", "import_file"]

# Smallest square input a torchvision model accepts in train mode where it is not 32 px:
# torchvision's weights metadata gives the pretrained eval minimum (Swin says 224 but
# runs at 32), so these were found by running the models (tests/test_zoo.py uses them).
MIN_IMAGE_SIZE = {
    "alexnet": 63,        # conv 11/4, three 3/2 max-pools
    "inception_v3": 75,   # without its auxiliary head; 299 with it
    "maxvit_t": 224,      # every block's input must be divisible by the 7x7 partition
}
DEFAULT_MIN_IMAGE_SIZE = 32
# Constructor arguments for torchvision models: no auxiliary heads (they need 299 px in train mode
# and add a second output), no scipy-based truncated-normal init (slow, and weights do not matter).
TORCHVISION_KWARGS = {
    "googlenet": {"init_weights": False, "aux_logits": False},
    "inception_v3": {"init_weights": False, "aux_logits": False},
}
SPEC_FORMS = "torchvision:NAME, timm:NAME or my.module:make_model"


class ModelSpecError(ValueError):
    """A model spec names nothing concur can build; the message says how to write it instead."""


@dataclass(frozen=True)
class ZooModel:
    """A model built from a spec, with the square input sizes it is made for and accepts."""

    spec: str
    model: nn.Module
    image_size: int      # what the model is made for: its weights' crop size, timm's input size
    min_image_size: int  # the smallest input it accepts
    fixed_size: bool = False  # it accepts ``image_size`` only (a ViT's position embeddings)
    size_known: bool = True  # False for a user's factory: ``image_size`` is only a guess

    def check_image_size(self, size: int) -> None:
        """Raise :class:`ModelSpecError` saying which size to use if ``size`` does not fit the model."""
        if self.fixed_size and size != self.image_size:
            raise ModelSpecError(f"{self.spec} takes {self.image_size} px inputs only, not {size}: "
                                 f"use --image-size {self.image_size} (the default)")
        if size < self.min_image_size:
            raise ModelSpecError(f"--image-size {size} is below the smallest input {self.spec} accepts "
                                 f"({self.min_image_size} px): use {self.min_image_size} or more, "
                                 f"or leave it out for its own {self.image_size}")


def load(spec: str) -> ZooModel:
    """Return the randomly initialised model ``spec`` names and its input sizes.

    Raises:
        ModelSpecError: the spec is malformed or names no model; the message gives a spec that works.
    """
    source, sep, name = spec.partition(":")
    if not sep or not source or not name:
        raise ModelSpecError(f"model spec {spec!r} must look like {SPEC_FORMS}{_guess(spec)}")
    if source == "torchvision":
        return _torchvision(spec, name)
    if source == "timm":
        return _timm(spec, name)
    return _factory(spec, source, name)


def build_model(spec: str) -> nn.Module:
    """Return the randomly initialised model ``spec`` names (see :func:`load`)."""
    return load(spec).model


def _guess(spec: str) -> str:
    """', e.g. torchvision:NAME' for a bare torchvision model name, else ''."""
    import torchvision

    return f"; did you mean torchvision:{spec}?" if spec in torchvision.models.list_models() else ""


def _torchvision(spec: str, name: str) -> ZooModel:
    import torchvision

    known = torchvision.models.list_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join('torchvision:' + c for c in close)}?" if close else \
            "torchvision.models.list_models() lists them"
        raise ModelSpecError(f"torchvision has no model {name!r}: {hint}")
    model = torchvision.models.get_model(name, weights=None, **TORCHVISION_KWARGS.get(name, {}))
    crop = torchvision.models.get_model_weights(name).DEFAULT.transforms().crop_size[0]
    fixed = getattr(model, "image_size", None)  # torchvision's ViTs are built for one size
    if isinstance(fixed, int):
        return ZooModel(spec, model, fixed, fixed, fixed_size=True)
    return ZooModel(spec, model, crop, MIN_IMAGE_SIZE.get(name, DEFAULT_MIN_IMAGE_SIZE))


def _timm(spec: str, name: str) -> ZooModel:
    try:
        timm = importlib.import_module("timm")
    except ImportError:
        raise ModelSpecError(f"{spec} needs timm, which is not installed: pip install timm") from None
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"did you mean {', '.join('timm:' + c for c in close)}?" if close else \
            "timm.list_models() lists them, e.g. timm:resnet50"
        raise ModelSpecError(f"timm has no model {name!r}: {hint}")
    model = timm.create_model(name, pretrained=False)
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    size = int(cfg.get("input_size", (3, 224, 224))[-1])
    if cfg.get("fixed_input_size"):
        return ZooModel(spec, model, size, size, fixed_size=True)
    minimum = cfg.get("min_input_size")  # unknown otherwise: a failure on a too small input says so
    return ZooModel(spec, model, size, int(minimum[-1]) if minimum else 1)


def import_from_cwd(module_name: str):
    """Return the module ``module_name``, looked up first in the current folder, as ``python -m`` does.

    The ``concur`` script's own folder, not the current one, heads ``sys.path``;
    the current folder is put first for this import only.
    """
    cwd = os.getcwd()
    added = not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path)
    if added:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a file written since the last import is seen
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


def import_file(path: Path):
    """Return the module in the file ``path``, its folder heading ``sys.path`` for this import only.

    ``python path/to/file.py`` finds the file's neighbours the same way, so a
    model file that imports a module beside it works from any folder.
    """
    name = path.stem
    taken = sys.modules.get(name)
    if taken is not None and getattr(taken, "__file__", None) != str(path):
        name = f"_concur_model_file_{name}"  # never shadow a module already imported under that name
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up by name while it is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if added:
            sys.path.remove(folder)
    return module


def _import_model_module(spec: str, module_name: str):
    """Return the module a factory spec names: a dotted name, or a ``.py`` file's path (relative or absolute).

    A file inside the current folder is imported by its dotted name, so that
    its relative imports work; one elsewhere (or in a folder that is no
    Python name) is imported from the file itself.
    """
    if not module_name.endswith(".py"):
        return import_from_cwd(module_name)
    path = Path(module_name).expanduser()
    if not path.is_file():
        where = "" if path.is_absolute() else f" in the current folder ({os.getcwd()})"
        raise ModelSpecError(f"{spec} names the file {module_name}, which does not exist{where}: give the path "
                             "of the .py file that defines the function, relative or absolute")
    path = path.resolve()
    try:
        parts = path.with_suffix("").relative_to(Path.cwd().resolve()).parts
    except ValueError:
        parts = ()
    if parts and all(p.isidentifier() for p in parts):
        return import_from_cwd(".".join(parts))
    return import_file(path)


def _where(exc: BaseException) -> str:
    """Return 'file:line' of the innermost frame of ``exc``'s traceback outside importlib ('' if none)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import_failure(spec: str, module_name: str, exc: BaseException) -> ModelSpecError:
    """Return the error for a model module that was not found, or was found and failed while importing."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
        return ModelSpecError(
            f"cannot import {module_name!r} for {spec} ({exc}): {module_name.replace('.', '/')}.py must be in "
            f"the current folder ({os.getcwd()}) or on PYTHONPATH, or use {SPEC_FORMS}")
    if isinstance(exc, SyntaxError):
        return ModelSpecError(f"{exc.filename}:{exc.lineno} has a syntax error ({exc.msg}): fix it to use {spec}")
    if missing is not None:
        return ModelSpecError(f"importing {module_name} for {spec} failed at {_where(exc)}: it imports {missing!r}, "
                              f"which Python cannot find: install it, or put its folder on PYTHONPATH")
    return ModelSpecError(f"importing {module_name} for {spec} failed at {_where(exc)}: {type(exc).__name__}: "
                          f"{_first_line(exc)}: fix that line (--debug shows the traceback)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _factory(spec: str, module_name: str, attr: str) -> ZooModel:
    try:
        module = _import_model_module(spec, module_name)
    except ModelSpecError:
        raise
    except Exception as exc:  # the module's own code ran and failed (SyntaxError is an Exception too)
        raise _import_failure(spec, module_name, exc) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"{module_name} has no callable {attr!r}: {spec} must name a function that "
                             "returns an nn.Module")
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise ModelSpecError(f"{spec} must be callable without arguments ({exc}): wrap it in a function "
                             "that passes them") from None
    except ValueError:  # a builtin without a signature: let the call itself say
        pass
    try:
        model = factory()
    except Exception as exc:
        raise ModelSpecError(f"{attr}() of {spec} raised at {_where(exc)}: {type(exc).__name__}: "
                             f"{_first_line(exc)}: fix it to return the model (--debug shows the traceback)") from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec} returned a {type(model).__name__}, not an nn.Module")
    return ZooModel(spec, model, 224, 1, size_known=False)  # sizes unknown: a failure on the input says so

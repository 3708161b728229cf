"""Import-time fix for vLLM CPU installs without torchvision (no model behaviour changes).

vLLM's GLM-5.3-Flash module imports vLLM's GLM-4.1V and Qwen2-VL code, which import
transformers' torchvision image processors (`models/<name>/image_processing_<name>.py`), whose
first lines import torchvision. glmctl's install removes torchvision (the only Linux wheels
for torch 2.13 are CUDA builds that break `import vllm`), so the model module could not even
be imported. transformers ships each of these processors on its PIL backend too
(`image_processing_pil_<name>.py`, class `<Name>ImageProcessorPil`). When torchvision is
absent, a meta-path finder serves the PIL module under the torchvision module's name, with the
PIL classes also under the torchvision class names. Text serving never calls them; image
inputs would be processed with PIL.

Installed in every process where the plugin acts on the CPU platform, including vLLM's
model-inspection subprocess, which imports model modules before any config exists. It only
answers imports that would otherwise fail with ModuleNotFoundError.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import re
import sys

_TORCHVISION_PROCESSOR = re.compile(r"^transformers\.models\.(\w+)\.image_processing_(?!pil_)(\w+)$")


def torchvision_installed() -> bool:
    return importlib.util.find_spec("torchvision") is not None


class PilImageProcessorFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves transformers' `image_processing_pil_<x>` as `image_processing_<x>`."""

    def find_spec(self, fullname, path=None, target=None):
        match = _TORCHVISION_PROCESSOR.match(fullname)
        if match is None:
            return None
        package, name = match.groups()
        pil_name = f"transformers.models.{package}.image_processing_pil_{name}"
        if importlib.util.find_spec(pil_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # default module object

    def exec_module(self, module) -> None:
        package, name = _TORCHVISION_PROCESSOR.match(module.__name__).groups()
        pil = importlib.import_module(f"transformers.models.{package}.image_processing_pil_{name}")
        public = {k: v for k, v in vars(pil).items() if not k.startswith("__")}
        module.__dict__.update(public)
        for attr, value in public.items():
            if attr.endswith("ImageProcessorPil"):
                module.__dict__.setdefault(attr[: -len("Pil")], value)


def serve_pil_image_processors() -> bool:
    """Install the finder (idempotent). False when torchvision is installed (nothing to do)."""
    if torchvision_installed():
        return False
    if not any(isinstance(f, PilImageProcessorFinder) for f in sys.meta_path):
        # First in line: the regular finder would locate the torchvision module and fail.
        sys.meta_path.insert(0, PilImageProcessorFinder())
    return True

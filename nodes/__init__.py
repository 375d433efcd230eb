"""LowBit's ComfyUI nodes (V3 API). Only this package (and its thin adapters) imports ComfyUI.

Each node lives in its own module; ``NODE_MODULES`` lists them in menu order. A module that fails
to import is logged and skipped, so one broken node never hides the others.
"""

from __future__ import annotations

import importlib
import logging

from comfy_api.latest import ComfyExtension, io

log = logging.getLogger(__name__)

CATEGORY = "LowBit"

#: module name -> node class names it defines
NODE_MODULES: dict[str, tuple[str, ...]] = {
    "loader": ("LowBitLoadDiffusionModel",),
    "quantize": ("LowBitQuantizeModel",),
    "save": ("LowBitSaveQuantizedModel",),
    "report": ("LowBitQuantizationReport",),
    "lora_nodes": ("LowBitLoraStackEntry", "LowBitApplyLoraStack", "LowBitLoadLora", "LowBitLoadLoraStack"),
    "compile": ("LowBitCompileQuantizedModel",),
    "calibrate": ("LowBitCalibratePolicy", "LowBitApplyPolicy"),
    "gptq": ("LowBitGPTQQuantizeModel",),
    "attention": ("LowBitAttentionBackend",),
    "kernel_tuner": ("LowBitKernelTuner",),
}


def node_classes() -> list[type[io.ComfyNode]]:
    classes = []
    for module_name, class_names in NODE_MODULES.items():
        try:
            module = importlib.import_module(f"{__name__}.{module_name}")
        except ModuleNotFoundError as err:
            if err.name == f"{__name__}.{module_name}":
                continue  # not written yet
            log.exception("LowBit: failed to import nodes.%s", module_name)
            continue
        except Exception:
            log.exception("LowBit: failed to import nodes.%s", module_name)
            continue
        classes.extend(getattr(module, name) for name in class_names if hasattr(module, name))
    return classes


def kernel_dispatch_cache_path() -> str:
    """Where the measured kernel choices are kept: ComfyUI's user directory (``user/lowbit/``)."""
    import os

    import folder_paths

    return os.path.join(folder_paths.get_user_directory(), "lowbit", "kernel_dispatch.json")


class LowBitExtension(ComfyExtension):
    async def on_load(self) -> None:
        # Kernel choices are measured once per (format, GPU, M bucket, N, K) and kept across runs.
        try:
            from ..kernels.dispatch import Dispatcher, install_dispatcher

            install_dispatcher(Dispatcher(cache_path=kernel_dispatch_cache_path()))
        except Exception:  # a broken cache location must not keep the nodes from loading
            log.exception("LowBit: could not set up the kernel dispatch cache; choices will not be kept")

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()

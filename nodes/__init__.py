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


class LowBitExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()

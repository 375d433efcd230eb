"""A layer's twin: a new module object of the same class sharing the layer's parameters, with none of the
state a module gathers while it runs.

Why merges need one: ComfyUI's Dynamic VRAM (``ModelPatcherDynamic``) keeps each weight where it was
loaded and streams it to the GPU in ``comfy.ops.cast_bias_weight``, caching what it streamed *per module
object* - a VRAM allocation (``_v``) trusted while its residency signature (``_v_signature``) holds, and a
pinned host copy (``_pins``) - both filled from the module's weight the first time it is cast. A weight
assigned into a module afterwards is never seen: a merge written into the base model's module runs as
the base weight once the base model has run. A merge therefore goes into a twin that ComfyUI puts in the
model as an object patch (``ModelPatcher.add_object_patch``), before it loads: the twin's caches are the
twin's, filled from the merged weight, and the base model's modules keep theirs.

Pure torch: no ComfyUI import. The attribute names below are ComfyUI's (``comfy/model_patcher.py``,
``comfy/ops.py``, ``comfy/pinned_memory.py``, ``comfy/weight_adapter/bypass.py``); a twin that inherited
them would read the source module's caches, or run the source module's forward.
"""

from __future__ import annotations

import torch

#: instance attributes that belong to one module object's run, never copied to a twin: Dynamic VRAM's
#: allocation, residency and staged views, its pinned host copies, a forward replaced on the instance
#: (ComfyUI's bypass hooks leave one bound to the source module), and the per-load weight functions; newer
#: ComfyUI's block-level vbar slot and CUDA graph too
RUN_STATE = frozenset({
    "_v", "_v_signature", "_v_weight", "_v_bias", "_prefetch", "_pins", "_pin_state",
    "_v_block", "_v_block_faulted", "_comfy_graph", "_compiled_prefetch_ring", "_comfy_cross_step_state",
    "forward", "weight_function", "bias_function", "weight_lowvram_function", "bias_lowvram_function",
})


def module_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A new ``type(module)`` object holding the same parameter and buffer tensors (shared, not copied)
    and the same configuration attributes, with empty hook tables and none of :data:`RUN_STATE`.

    Assigning a parameter of the twin leaves ``module`` as it was. Forward hooks and pre-hooks of
    ``module`` are not carried over (LowBit's and ComfyUI's LoRA hooks are attached per injection).
    """
    cls = type(module)
    twin = cls.__new__(cls)
    torch.nn.Module.__init__(twin)  # torch's own tables (parameters, buffers, hooks): new and empty
    own = set(twin.__dict__)
    for name, value in module.__dict__.items():
        if name not in own and name not in RUN_STATE and not name.startswith("_v_"):
            twin.__dict__[name] = value
    twin._parameters.update(module._parameters)
    twin._buffers.update(module._buffers)
    twin._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    twin._modules.update(module._modules)
    twin.training = module.training
    return twin

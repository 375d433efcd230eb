"""Compile Quantized Model (LowBit): ``torch.compile`` for quantized diffusion models, lazily and safely.

What the node does (each point is a fix for a way stock compile goes wrong on quantized models):

* **Compiles at the first sampling call.** The node only adds an ``APPLY_MODEL`` wrapper; the wrapper
  looks the model's modules up on every call, so object patches, LoRA injections and weight patches
  applied after the node (or by the sampler) are what gets compiled.
* **Repeated blocks share one compiled function.** Every ``nn.ModuleList`` of blocks of one class
  (Flux's ``double_blocks`` / ``single_blocks``, a DiT's ``blocks``...) runs through one
  ``torch.compile`` of that class's ``forward``; the blocks' weights are graph inputs, so N blocks cost
  one trace. The compiled functions are kept per process (per block class and settings): running
  the node again, cloning the model or changing a LoRA does not start a new compile.
* **Quantized linears are one custom op each** (``lowbit::quantized_linear``, with a fake), so
  ``fullgraph=True`` traces every LowBit format (``quant/compiled_linear.py``).
* **No recompilation storms.** Guards on ``transformer_options`` (block index, sigmas, patches...)
  are dropped, as stock ComfyUI does. With ``dynamic = tokens`` every dimension but the last of the
  blocks' tensor inputs is marked dynamic from the first call, so one graph serves every resolution
  (the bucket is: batch 1, or batch >= 2; any token count >= 2). Dynamic LoRA strengths live in
  tensors edited in place, and swapping LoRAs of the same ranks swaps tensors of the same shapes:
  neither is guarded on (adding or removing hooks is: empty hook dictionaries are guarded too, so a
  LoRA attached after a compile is never skipped). Dynamo's recompile limit is raised to
  ``recompile_limit`` (never lowered).
* **Dynamic VRAM**: the branch after the node is demoted to a regular ModelPatcher, as stock
  compile does (Dynamic VRAM's per-layer streaming cannot run inside a compiled graph). A model
  LowBit made, or one without a loader recipe, becomes a regular copy sharing its weights
  (:func:`non_dynamic_copy`) instead of being rebuilt from its file.
* **Falls back to eager with a warning** naming the error when compiling fails, instead of failing
  the workflow; the model then runs uncompiled for the rest of the session.
"""

from __future__ import annotations

import copy
import functools
import logging
import types
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from comfy_api.latest import io
from comfy_kitchen.tensor import QuantizedTensor

from . import CATEGORY
from ..quant import compile_fusion
from ..quant.errors import LowBitError
from .common import NodeInputError

log = logging.getLogger(__name__)

SETTINGS_VERSION = 1
WRAPPER_KEY = "lowbit.compile"
STOCK_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY
BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
SCOPES = ("blocks", "diffusion_model")
DYNAMIC = ("tokens", "static")
#: compile errors that make the wrapper fall back to eager (anything else is the model's own error)
COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,
                                                   torch._dynamo.exc.FailOnRecompileLimitHit)


@dataclass(frozen=True)
class CompileSettings:
    """How to compile. Validates itself; round-trips through :meth:`to_dict`.

    ``backend``/``mode``: ``torch.compile``'s (``mode`` only for inductor). ``scope``: ``blocks``
    compiles each repeated block class once, ``diffusion_model`` compiles the whole forward.
    ``dynamic``: ``tokens`` marks every non-feature dimension dynamic from the first call (one graph
    for all resolutions), ``static`` specializes on shapes (a new resolution compiles again).
    ``fullgraph``: fail (and fall back to eager) on a graph break instead of splitting the graph.
    ``recompile_limit``: Dynamo's per-function limit is raised to at least this.
    ``fuse_gelu`` (inductor): quantized linears fed ``gelu(b)`` or ``cat([a, gelu(b)])`` quantize
    their input in one kernel with the GELU (``quant/compile_fusion.py``).
    """

    backend: str = "inductor"
    mode: str = "default"
    scope: str = "blocks"
    dynamic: str = "tokens"
    fullgraph: bool = False
    recompile_limit: int = 32
    fuse_gelu: bool = True
    version: int = SETTINGS_VERSION

    def __post_init__(self):
        for name, allowed in (("backend", BACKENDS), ("mode", MODES), ("scope", SCOPES), ("dynamic", DYNAMIC)):
            if getattr(self, name) not in allowed:
                raise NodeInputError(f"compile {name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.mode != "default" and self.backend != "inductor":
            raise NodeInputError(f"compile mode {self.mode!r} needs the inductor backend, got {self.backend!r}; "
                                 f"fix: set mode to default or backend to inductor")
        limit = self.recompile_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1024:
            raise NodeInputError(f"recompile_limit must be an integer from 1 to 1024, got {limit!r}")
        for name in ("fullgraph", "fuse_gelu"):
            if not isinstance(getattr(self, name), bool):
                raise NodeInputError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.version != SETTINGS_VERSION:
            raise NodeInputError(f"compile settings version {self.version} is not supported "
                                 f"(expected {SETTINGS_VERSION})")

    def to_dict(self) -> dict:
        return {"backend": self.backend, "mode": self.mode, "scope": self.scope, "dynamic": self.dynamic,
                "fullgraph": self.fullgraph, "recompile_limit": self.recompile_limit, "fuse_gelu": self.fuse_gelu,
                "version": self.version}

    @classmethod
    def from_dict(cls, data: dict) -> "CompileSettings":
        return cls(**data)

    def compile_key(self) -> tuple:
        """What makes two compiled functions different (the recompile limit does not)."""
        return (self.backend, self.mode, self.dynamic, self.fullgraph, self.fuse_gelu)


# ---- guards, limits, dynamic dimensions ----------------------------------------------------------------

def skip_transformer_options_guards(guard_entries) -> list[bool]:
    """Keep every guard except those on ``transformer_options`` (block index, sigmas, patch lists...)."""
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def raise_recompile_limits(limit: int) -> None:
    """Raise Dynamo's per-function and accumulated recompile limits to at least ``limit`` / ``8 * limit``."""
    config = torch._dynamo.config
    if config.recompile_limit < limit:
        log.info("LowBit compile: Dynamo recompile_limit %d -> %d", config.recompile_limit, limit)
        config.recompile_limit = limit
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * limit)


def mark_dynamic_dims(value) -> None:
    """Mark every dimension but the last of each tensor in ``value`` (a tensor, or a tuple/list of them)
    as dynamic, where it has at least 2 elements. Dimensions the model's code fixes (a head size a
    reshape needs) are specialized by Dynamo without error (``maybe_mark_dynamic``); dictionaries
    (``transformer_options``) are left alone."""
    if isinstance(value, torch.Tensor):
        for dim in range(value.dim() - 1):
            if value.shape[dim] >= 2:
                torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            mark_dynamic_dims(item)


# ---- the compiled functions (one per class and settings, for the whole process) -------------------------

_COMPILED: "weakref.WeakKeyDictionary[type, dict[tuple, Callable]]" = weakref.WeakKeyDictionary()


def mode_options(mode: str) -> dict:
    """The inductor options ``torch.compile(mode=mode)`` would use (``{}`` for ``default``)."""
    if mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def on_copied_inputs(forward: Callable) -> Callable:
    """``forward`` run on copies of its tensor arguments, inside the compiled graph.

    Inductor's CUDA graphs skip a graph that mutates its inputs ("skipping cudagraphs due to mutated
    inputs"), and ComfyUI's blocks add into theirs in place (Flux: ``img += ...``), so with
    ``reduce-overhead`` / ``max-autotune`` no block ran as a CUDA graph. The copies are made inside
    the graph, where the in-place adds become out-of-place ones; the blocks' callers use the returned
    tensors, never their inputs' new contents.
    """
    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        return forward(self, *args, **kwargs)

    return run


def compiled_forward(cls: type, settings: CompileSettings) -> Callable:
    """The ``torch.compile`` of ``cls.forward`` for ``settings``, made once per process.

    Reusing the same compiled function is what keeps a second run of the node (a new LoRA strength,
    a cloned model) from compiling again: Dynamo's cache entries belong to the function's backend.
    """
    per_class = _COMPILED.setdefault(cls, {})
    key = settings.compile_key()
    fn = per_class.get(key)
    if fn is None:
        # torch.compile takes a mode or options, not both: a mode is passed as the inductor options it stands for
        options = {**mode_options(settings.mode), "guard_filter_fn": skip_transformer_options_guards}
        if settings.backend == "inductor" and settings.fuse_gelu and compile_fusion.supported():
            options["pre_grad_custom_pass"] = compile_fusion.GeluLinearFusion()
        target = cls.forward
        if options.get("triton.cudagraphs"):
            target = on_copied_inputs(target)
        fn = torch.compile(target, backend=settings.backend, fullgraph=settings.fullgraph,
                           dynamic=False if settings.dynamic == "static" else None, options=options)
        per_class[key] = fn
    return fn


def repeated_blocks(diffusion_model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The ``nn.ModuleList``s of at least two modules of one class (outermost lists only), by name."""
    found: list[tuple[str, torch.nn.ModuleList]] = []
    for name, module in diffusion_model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _runner(compiled: Callable, dynamic: bool, copy_outputs: bool = False) -> Callable:
    """A block's forward through ``compiled``. ``copy_outputs`` (CUDA-graph modes): the outputs are
    copied out of the CUDA graph's memory pool. All the blocks of a class replay one compiled function,
    and each call of it starts a new "generation" for inductor's CUDA graph trees, which reuses the
    pool the previous call's outputs live in: the next block would read overwritten inputs."""
    def forward(self, *args, **kwargs):
        if dynamic:
            mark_dynamic_dims(args)
            mark_dynamic_dims(tuple(kwargs.values()))
        out = compiled(self, *args, **kwargs)
        if copy_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    return forward


@dataclass
class CompileState:
    """What a wrapper has done (read by tests and the log)."""

    calls: int = 0
    regions: tuple[str, ...] = ()
    failure: str | None = None  # why the model now runs eager


class CompileWrapper:
    """The ``APPLY_MODEL`` wrapper: installs the compiled forwards for one call, then takes them off."""

    def __init__(self, settings: CompileSettings):
        self.settings = settings
        self.state = CompileState()

    def regions(self, base_model) -> list[tuple[str, torch.nn.Module]]:
        dm = base_model.diffusion_model
        if self.settings.scope == "diffusion_model":
            return [("diffusion_model", dm)]
        regions = [(f"diffusion_model.{name}.{i}", block)
                   for name, blocks in repeated_blocks(dm) for i, block in enumerate(blocks)]
        if not regions:  # nothing repeats: compile the whole forward rather than nothing
            log.info("LowBit compile: %s has no repeated blocks; compiling its whole forward", type(dm).__name__)
            regions = [("diffusion_model", dm)]
        return regions

    def __call__(self, executor, *args, **kwargs):
        self.state.calls += 1
        if self.state.failure is not None:
            return executor(*args, **kwargs)
        regions = self.regions(executor.class_obj)
        self.state.regions = tuple(sorted({type(module).__qualname__ for _, module in regions}))
        raise_recompile_limits(self.settings.recompile_limit)
        installed = self._install(regions)
        try:
            # Dynamo skips guards on *empty* hook dicts by default: a block compiled before a Dynamic
            # LoRA hooked its layers would then run without the LoRA. Guard them (a length check each).
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
                return executor(*args, **kwargs)
        except COMPILE_ERRORS as err:
            self.state.failure = f"{type(err).__name__}: {_first_lines(str(err))}"
            log.warning(
                "LowBit compile: compiling %s failed, so this model runs uncompiled (eager) from now on. "
                "Error: %s. Fix: try fullgraph=false, backend=aot_eager to see whether the backend or the "
                "graph is at fault, or run with TORCH_LOGS=graph_breaks for details.",
                ", ".join(self.state.regions) or "the model", self.state.failure)
        finally:
            _uninstall(installed)
        return executor(*args, **kwargs)

    def _install(self, regions) -> list[tuple[torch.nn.Module, object]]:
        installed = []
        dynamic = self.settings.dynamic == "tokens"
        cuda_graphs = mode_options(self.settings.mode).get("triton.cudagraphs")
        for _, module in regions:
            forward = types.MethodType(_runner(compiled_forward(type(module), self.settings), dynamic,
                                               copy_outputs=bool(cuda_graphs)), module)
            installed.append((module, module.__dict__.get("forward", _ABSENT)))
            module.forward = forward
        return installed


_ABSENT = object()


def _uninstall(installed) -> None:
    for module, previous in reversed(installed):
        if previous is _ABSENT:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous


def _first_lines(text: str, lines: int = 3, limit: int = 500) -> str:
    return " ".join(text.strip().splitlines()[:lines])[:limit]


# ---- the node ---------------------------------------------------------------------------------------

def demoted_clone(model):
    """A clone of ``model`` that does not run under Dynamic VRAM (stock compile's ``disable_dynamic``).

    A compiled region must not hold a Dynamic VRAM layer: ComfyUI's cast streams its weight through
    comfy-aimdo's ctypes calls, which Dynamo cannot trace, or, for an input on the CPU, dequantizes
    it there (comfy-kitchen's 4-bit dequantize reads a cached real Hadamard matrix, which a
    fake-tensor trace cannot take in). Stock TorchCompileModel rebuilds the model from its loader's
    ``cached_patcher_init`` as a regular ModelPatcher. This node:

    * not Dynamic VRAM: a plain clone;
    * a model LowBit quantized or loaded (``model.lowbit_info``), or one with no loader recipe
      (built from a state dict, a custom loader): :func:`non_dynamic_copy`, a regular ModelPatcher
      over a copy of the module tree sharing the weights (nothing is read again or re-quantized,
      which rebuilding a model Quantize made from its float file would do);
    * any other model: stock's rebuild.
    """
    from .model_quant import model_info

    is_dynamic = getattr(model, "is_dynamic", None)
    if is_dynamic is None or not is_dynamic():
        return model.clone()
    if model_info(model) is None and getattr(model, "cached_patcher_init", None) is not None:
        rebuilt = model.clone(disable_dynamic=True)
        rebind_lora_injections(model, rebuilt)
        return rebuilt
    return non_dynamic_copy(model)


def non_dynamic_copy(model):
    """A regular (non Dynamic VRAM) ModelPatcher over a copy of ``model``'s module tree.

    The copy shares the weight storage (``model_quant.copy_model``: new modules and Parameter objects,
    no tensor copies, no Dynamic VRAM state such as ``_v``); ``model`` is unloaded first so the copy
    sees its unpatched weights. Float weights a Dynamic VRAM load kept in the file's dtype are cast to
    the dtype the model was built in (``<param>_comfy_model_dtype``), as a regular load does. Patches,
    wrappers, injections and ``lowbit_info`` carry over; the copy is its own model to ComfyUI's model
    manager (no parent, its own ``clone_base_uuid``).
    """
    from .model_quant import INFO_ATTR, copy_model, ensure_unpatched

    ensure_unpatched(model, offloaded=True)
    source = model.model
    new_model = copy_model(source, model.offload_device)
    _drop_foreign_forwards(new_model)
    cast = _cast_to_model_dtypes(new_model)
    info = getattr(source, INFO_ATTR, None)
    if info is not None:
        setattr(new_model, INFO_ATTR, info)
    demoted = model.clone(disable_dynamic=True, model_override=(new_model, ({}, {}, {}, set())))
    demoted.parent = None  # the model manager must not fall back to the Dynamic VRAM patcher's model
    demoted.clone_base_uuid = uuid.uuid4()
    demoted.size = 0
    demoted.hook_backup = {}
    rebind_lora_injections(model, demoted)
    log.info("LowBit compile: %s leaves Dynamic VRAM as a regular copy sharing its weights (%d weights cast to "
             "the model dtype)", type(source).__name__, cast)
    return demoted


class LoraRebindError(LowBitError):
    """A LowBit LoRA stack on a model leaving Dynamic VRAM holds something the compile node cannot move."""


def rebind_lora_injections(source, demoted) -> int:
    """Point the LowBit LoRA stacks ``demoted`` inherited from ``source`` at ``demoted``'s own modules.

    A stack's appliers hold the module tree they were applied to: Dynamic banks hook
    ``DynamicLoras.root``'s layers, Stochastic (and Dynamic's DoRA) merges swap weights under
    ``StochasticMerge.root``, and ComfyUI's bypass hooks (LoHa, LoKr, diffs) each hold one module
    object. ``clone()`` copies the injection list, not what it points at, so a demoted model with a
    module tree of its own (the copy, or stock's rebuild) would inject the LoRA into ``source``'s
    modules and run without it. Each applier is copied with those references replaced by the same
    paths resolved in ``demoted`` (its object patches first, as ComfyUI's ``get_model_object`` does);
    the banks, deltas and adapters are shared, not copied. ComfyUI weight patches (Standard mode) are
    keyed by name and need nothing. Returns how many appliers were rebound.
    """
    from .lora_nodes import INJECTION_KEY

    if demoted.model is source.model:
        return 0
    demoted.is_injected = False  # its modules are not hooked yet, whatever the source's state
    _copy_module_object_patches(demoted)
    injections = demoted.injections.get(INJECTION_KEY)
    others = sorted(k for k in demoted.injections if k != INJECTION_KEY)
    if others:
        log.warning("LowBit compile: injections %s are carried to the model leaving Dynamic VRAM as they are; "
                    "any module they hold is the Dynamic VRAM model's, not the compiled one's", ", ".join(others))
    if not injections:
        return 0
    paths = _module_paths(source)
    rebound = []
    count = 0
    for injection in injections:
        new = copy.copy(injection)
        new.appliers = tuple(_rebound_applier(applier, paths, demoted) for applier in injection.appliers)
        count += len(new.appliers)
        rebound.append(new)
    demoted.set_injections(INJECTION_KEY, rebound)
    log.info("LowBit compile: %d LoRA stack(s) rebound to the model leaving Dynamic VRAM", count)
    return count


def _copy_module_object_patches(demoted) -> None:
    """Module-valued object patches (LoRA merge twins) become copies without Dynamic VRAM state: the
    source patcher's loads gave the twins it installed their own vbar allocation (``_v``) and cast flags,
    which the demoted model would otherwise stream its merged weights through (stale, and untraceable)."""
    from .model_quant import copy_model

    for path, value in list(demoted.object_patches.items()):
        if isinstance(value, torch.nn.Module):
            module = copy_model(value)
            _drop_foreign_forwards(module)
            _cast_to_model_dtypes(module)
            demoted.object_patches[path] = module


def _module_paths(patcher) -> dict[int, str]:
    """``id(module) -> path`` for every module ``patcher``'s LoRA appliers may hold: its model's, its
    object patches (merge twins) and the modules those patches replace."""
    paths = {id(module): name for name, module in patcher.model.named_modules()}
    for table in (patcher.object_patches_backup, patcher.object_patches):
        for name, value in table.items():
            if isinstance(value, torch.nn.Module):
                paths[id(value)] = name
    return paths


def _rebound_applier(applier, paths: dict[int, str], demoted):
    from ..lora.attach import DynamicLoras, StochasticMerge

    new = copy.copy(applier)
    for name, value in vars(applier).items():
        if isinstance(value, DynamicLoras):
            loras = copy.copy(value)
            loras.root, loras._handles = demoted.model, []  # banks and strengths shared
            setattr(new, name, loras)
        elif isinstance(value, StochasticMerge):
            merge = copy.copy(value)
            merge.root, merge._originals, merge._kept = demoted.model, {}, {}
            setattr(new, name, merge)
        elif name == "bypass":
            setattr(new, name, [_rebound_bypass(injection, paths, demoted) for injection in value])
        elif isinstance(value, torch.nn.Module):
            raise LoraRebindError(f"LoRA applier {type(applier).__name__}.{name} holds a module the compile node "
                                  f"does not know how to move to the model leaving Dynamic VRAM; expected only "
                                  f"DynamicLoras, StochasticMerge and bypass injections; fix: teach "
                                  f"nodes/compile.py's rebind_lora_injections about it")
    return new


def _rebound_bypass(injection, paths: dict[int, str], demoted):
    """A copy of one bypass injection (``lora_nodes._bypass_injections``) whose hooks wrap ``demoted``'s modules."""
    from comfy.weight_adapter.bypass import BypassForwardHook

    from .lora_nodes import hooks_injection

    hooks = _closure_value(injection.inject, "hooks")
    if hooks is None or not all(isinstance(h, BypassForwardHook) for h in hooks):
        raise LoraRebindError("a LowBit LoRA bypass injection no longer keeps its BypassForwardHooks in a closure "
                              "variable 'hooks' (found none); expected lora_nodes._bypass_injections' layout; fix: "
                              "update nodes/compile.py's _rebound_bypass with it")
    new_hooks = []
    for hook in hooks:
        path = paths.get(id(hook.module))
        if path is None:
            raise LoraRebindError(f"a LoRA bypass hook wraps a {type(hook.module).__name__} that is neither in the "
                                  f"model nor one of its object patches; expected a module of the model; fix: apply "
                                  f"the LoRA to the model given to the compile node")
        new_hooks.append(BypassForwardHook(demoted.get_model_object(path), hook.adapter, multiplier=hook.multiplier))
    return hooks_injection(new_hooks)


def _closure_value(fn, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _drop_foreign_forwards(model: torch.nn.Module) -> int:
    """Remove instance-level ``forward``s that run another object's code than the module's own: ComfyUI's
    bypass hook leaves the source module's bound ``forward`` on its instance when it ejects, and a copy
    of that module would otherwise run the *source* module (its Dynamic VRAM cast included) forever."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and getattr(forward, "__self__", module) is not module:
            del module.__dict__["forward"]
            count += 1
    return count


def _cast_to_model_dtypes(model: torch.nn.Module) -> int:
    """Cast float parameters held in another dtype than ``<name>_comfy_model_dtype`` to it; returns how many."""
    count = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            dtype = module.__dict__.get(f"{name}_comfy_model_dtype")
            if (param is None or dtype is None or param.dtype == dtype or isinstance(param, QuantizedTensor)
                    or not param.is_floating_point() or not dtype.is_floating_point):
                continue
            module._parameters[name] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            count += 1
    return count


def compile_model(model, settings: CompileSettings):
    """A clone of ``model`` that compiles at its first sampling call (the node's work)."""
    from comfy.patcher_extension import WrappersMP

    patched = demoted_clone(model)
    if patched.get_wrappers(WrappersMP.APPLY_MODEL, STOCK_COMPILE_KEY):
        log.info("LowBit compile: replacing the stock TorchCompileModel wrapper on this model")
        patched.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, STOCK_COMPILE_KEY)
    patched.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    patched.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, CompileWrapper(settings))
    return patched


def compile_wrapper(model) -> CompileWrapper | None:
    """The LowBit compile wrapper on ``model``, if any."""
    from comfy.patcher_extension import WrappersMP

    wrappers = model.get_wrappers(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    return wrappers[0] if wrappers else None


class LowBitCompileQuantizedModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitCompileQuantizedModel",
            display_name="Compile Quantized Model (LowBit)",
            category=CATEGORY,
            description=(
                "torch.compile for quantized (and float) diffusion models: compiles at the first sampling call, "
                "repeated blocks share one compile, LoRA strength changes and resolution changes do not "
                "recompile, and a failed compile falls back to eager with a warning."),
            inputs=[
                io.Model.Input("model", tooltip="A diffusion model, quantized by LowBit or not. Put LoRA and "
                               "patch nodes before or after this node: compiling waits for the first sampling call."),
                io.Combo.Input("backend", options=list(BACKENDS), default="inductor",
                               tooltip="inductor: generated kernels (fastest). cudagraphs: CUDA graphs only. "
                               "aot_eager / eager: debugging (trace only, no speed-up)."),
                io.Combo.Input("mode", options=list(MODES), default="default", optional=True,
                               tooltip="inductor's mode. max-autotune tries more kernel configurations (slow first "
                               "run); reduce-overhead adds CUDA graphs, which quantized models need to keep a fast "
                               "GPU fed (H200, Flux: 1.46x compiled bf16 against 1.35x with default)."),
                io.Combo.Input("scope", options=list(SCOPES), default="blocks", optional=True,
                               tooltip="blocks: compile each repeated transformer block class once (fast first run). "
                               "diffusion_model: compile the whole forward."),
                io.Combo.Input("dynamic", options=list(DYNAMIC), default="tokens", optional=True,
                               tooltip="tokens: one compiled graph for every resolution (no recompiles when the "
                               "image size changes). static: specialize on the size (a new size compiles again)."),
                io.Boolean.Input("fullgraph", default=False, optional=True,
                                 tooltip="Fail on any graph break (then run uncompiled, with a warning) instead of "
                                 "splitting the block into several graphs."),
                io.Int.Input("recompile_limit", default=32, min=1, max=1024, optional=True,
                             tooltip="Dynamo's recompile limit per compiled function is raised to at least this."),
            ],
            outputs=[io.Model.Output(
                tooltip="The model, compiled at its first sampling call (the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, backend: str = "inductor", mode: str = "default", scope: str = "blocks",
                dynamic: str = "tokens", fullgraph: bool = False, recompile_limit: int = 32) -> io.NodeOutput:
        settings = CompileSettings(backend=backend, mode=mode, scope=scope, dynamic=dynamic,
                                   fullgraph=bool(fullgraph), recompile_limit=int(recompile_limit))
        return io.NodeOutput(compile_model(model, settings))


__all__ = ["CompileSettings", "CompileState", "CompileWrapper", "LoraRebindError", "LowBitCompileQuantizedModel",
           "compile_model", "compile_wrapper", "compiled_forward", "demoted_clone", "mark_dynamic_dims",
           "non_dynamic_copy", "rebind_lora_injections", "repeated_blocks", "skip_transformer_options_guards"]

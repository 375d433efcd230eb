"""The ``lowbit`` command line: quantize checkpoints, inspect them, list the formats.

    python -m lowbit quantize IN.safetensors OUT.safetensors --mode int8_convrot
    python -m lowbit quantize IN.safetensors OUT.safetensors --policy POLICY.json
    python -m lowbit quantize --demo demo_int8_convrot.safetensors
    python -m lowbit calibrate IN.safetensors POLICY.json --budget ratio:0.2
    python -m lowbit inspect FILE.safetensors [--mode MODE] [--preset PRESET]
    python -m lowbit formats [--markdown]
    python -m lowbit bench kernels [ARGS ...]

stdout carries only each command's result (its table); messages go through ``logging`` to stderr.
Exit codes: 0 success; 2 a user error (one line on stderr; ``--debug`` adds the traceback); 1 an
unexpected error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Iterable, Sequence

from .quant.errors import LowBitError, OutputExistsError

log = logging.getLogger("lowbit.cli")

PROG = "lowbit"
DEMO_SOURCE_NAME = "tiny_flux_bf16.safetensors"  # the demo's float source, written next to OUT
DEMO_MODE = "int8_convrot"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: errors a user causes (bad names, missing or existing files): one line, exit code 2
USER_ERRORS = (LowBitError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
               PermissionError)
EXIT_USER_ERROR = 2
QUIET_LOGGERS = ("comfy_kitchen", "triton", "torch")  # held at WARNING unless --debug
GPU_GENERATIONS = {(7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 9): "Ada", (9, 0): "Hopper",
                   (10, 0): "Blackwell", (12, 0): "Blackwell"}
#: calibrate --smoothing (quant.calibrate.SMOOTHING_MODES, spelled out so --help does not import torch)
SMOOTHING_CHOICES = ("write", "measure", "off")
FORMAT_COLUMNS = ("format", "weight bits", "activations", "comfy_quant format", "stock ComfyUI loads",
                  "fast path GPU", "fallback")


# ---- tables ---------------------------------------------------------------------------------

def text_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, with a dashed rule under the header."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def human_bytes(n: int | float) -> str:
    """``1536`` → ``1.5 KiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def gpu_requirement(min_sm: tuple[int, int] | None) -> str:
    if min_sm is None:
        return "any"
    name = GPU_GENERATIONS.get(tuple(min_sm))
    return f"SM {min_sm[0]}.{min_sm[1]}+" + (f" ({name})" if name else "")


def format_rows() -> list[tuple[str, ...]]:
    """One row per registered format, in registry order (the ``formats`` command and README table)."""
    from .quant.formats import FORMATS

    rows = []
    for spec in (codec.spec for codec in FORMATS.values()):
        rows.append((spec.name, str(spec.weight_bits), spec.activation, spec.native_format,
                     "yes" if spec.stock_loadable else "no: LowBit loader", gpu_requirement(spec.min_sm),
                     spec.fallback or "-"))
    return rows


def formats_markdown() -> str:
    """The Markdown formats table that README.md and docs/formats.md embed (tests keep them equal)."""
    rows = [(f"`{r[0]}`", r[1], r[2], f"`{r[3]}`", *r[4:6], f"`{r[6]}`" if r[6] != "-" else "-")
            for r in format_rows()]
    return markdown_table(FORMAT_COLUMNS, rows)


DETAIL_COLUMNS = ("format", "what it is", "stored per layer", "input width multiple of")


def format_detail_rows() -> list[tuple[str, ...]]:
    """Per format: its description, the tensors it stores per layer, and the input width it needs."""
    from .quant.formats import FORMATS

    return [(codec.spec.name, codec.spec.description, ", ".join((*codec.tensor_keys, "comfy_quant")),
             str(codec.spec.in_features_multiple)) for codec in FORMATS.values()]


def format_details_markdown() -> str:
    """The per-format detail table of docs/formats.md (tests keep it equal to the registry)."""
    rows = [(f"`{name}`", description, ", ".join(f"`{key}`" for key in stored.split(", ")), multiple)
            for name, description, stored, multiple in format_detail_rows()]
    return markdown_table(DETAIL_COLUMNS, rows)


# ---- checkpoint reports ---------------------------------------------------------------------

REPORT_COLUMNS = ("format", "layers", "params", "before (bf16)", "after", "after/before")


def summary_table(path: Path, *, per_layer: bool = False) -> str:
    """Layers, parameters and bytes per stored format of a checkpoint (``before`` = those weights as bf16)."""
    from .quant.checkpoint import LOWBIT_PLAN_KEY, inspect_checkpoint
    from .quant.formats import FORMATS

    summary = inspect_checkpoint(path)
    groups: dict[str, list[int]] = {}
    for layer in summary.layers:
        codec = FORMATS.get(layer.format)
        # stored quantized weights are one byte per element holding 8 // weight_bits values
        params = _numel(layer.stored_shape) * (8 // codec.spec.weight_bits if codec else 1)
        _add(groups, layer.format, params, 2 * params, layer.bytes)
    title = f"{path}: {human_bytes(summary.file_bytes)}, {summary.tensor_count} tensors"
    written_by = _lowbit_plan(summary.metadata.get(LOWBIT_PLAN_KEY))
    if written_by:
        title += f"; written by LowBit with {written_by}"
    lines = [title, _report(groups, summary.other_bytes)]
    if per_layer:
        lines += ["", text_table(("layer", "stored shape", "format", "bytes"), [
            (layer.name, "x".join(map(str, layer.stored_shape)), layer.format, human_bytes(layer.bytes))
            for layer in summary.layers])]
    return "\n".join(lines)


def plan_table(path: Path, policy, *, per_layer: bool = False) -> str:
    """For a float checkpoint: what ``policy`` would make of it, with bytes before (bf16) and after."""
    from .quant.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        infos, file_bytes = dict(reader.tensors), reader.file_size
    plan = policy.plan({key: info.shape for key, info in infos.items()})
    decisions = {f"{d.name}.weight": d for d in plan.layers}
    groups: dict[str, list[int]] = {}
    other = 0
    for key, info in infos.items():
        decision = decisions.get(key)
        if decision is not None and decision.format is not None:
            after = layer_bytes(decision.format, decision.shape)
            _add(groups, decision.format, decision.params, 2 * decision.params, after)
        elif key.endswith(".weight") and len(info.shape) >= 2:
            _add(groups, "float", _numel(info.shape), 2 * _numel(info.shape), info.nbytes)
        else:
            other += info.nbytes
    title = (f"{path}: float checkpoint, {human_bytes(file_bytes)}, {len(infos)} tensors; "
             f"plan for mode {plan.mode}, preset {plan.preset}")
    lines = [title, _report(groups, other)]
    if per_layer:
        lines += ["", plan.table()]
    return "\n".join(lines)


def _lowbit_plan(raw: str | None) -> str:
    """``mode M, preset P`` from a file's ``lowbit_plan`` metadata ('' when absent or unreadable)."""
    try:
        plan = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return ""
    if not isinstance(plan, dict):
        return ""
    return ", ".join(f"{key} {plan[key]}" for key in ("mode", "preset") if key in plan)


def layer_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Exact bytes that a ``[N, K]`` weight takes in format ``fmt``: tensors plus its ``comfy_quant``."""
    from .quant.native import layer_bytes as stored

    return stored(fmt, shape)


def _add(groups: dict[str, list[int]], fmt: str, params: int, before: int, after: int) -> None:
    group = groups.setdefault(fmt, [0, 0, 0, 0])
    for i, value in enumerate((1, params, before, after)):
        group[i] += value


def _report(groups: dict[str, list[int]], other_bytes: int) -> str:
    from .quant.formats import FORMATS

    order = [f for f in FORMATS if f in groups] + sorted(f for f in groups if f not in FORMATS)
    rows, total = [], [0, 0, other_bytes, other_bytes]
    for fmt in order:
        layers, params, before, after = groups[fmt]
        rows.append((fmt, str(layers), f"{params:,}", human_bytes(before), human_bytes(after), _ratio(after, before)))
        total = [t + v for t, v in zip(total, groups[fmt])]
    rows.append(("other tensors", "", "", human_bytes(other_bytes), human_bytes(other_bytes), ""))
    rows.append(("total", str(total[0]), f"{total[1]:,}", human_bytes(total[2]), human_bytes(total[3]),
                 _ratio(total[3], total[2])))
    return text_table(REPORT_COLUMNS, rows)


def _ratio(after: int, before: int) -> str:
    return f"{after / before:.0%}" if before else ""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- commands -------------------------------------------------------------------------------

def cmd_formats(args: argparse.Namespace) -> int:
    if args.details:
        print(format_details_markdown() if args.markdown else text_table(DETAIL_COLUMNS, format_detail_rows()))
    else:
        print(formats_markdown() if args.markdown else text_table(FORMAT_COLUMNS, format_rows()))
    return 0



@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, desc: str, unit: str):
    """A tqdm bar (silent with ``--quiet``) that logging writes around, as a ``progress(done, total)`` callback."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    quiet = getattr(args, "quiet", False)
    with logging_redirect_tqdm(), tqdm(desc=desc, unit=unit, disable=True if quiet else None,
                                       dynamic_ncols=True, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield progress


def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from .quant.checkpoint import open_checkpoint
    from .quant.convert import convert_file
    from .quant.policy import Policy, all_modes
    from .quant.safetensors_file import check_output_path

    if args.demo:
        if len(args.paths) != 1:
            raise LowBitError(f"quantize --demo takes one path, OUT; got {len(args.paths)}: {' '.join(args.paths) or '(none)'}")
    elif len(args.paths) != 2:
        raise LowBitError(f"quantize takes two paths, IN and OUT (or --demo OUT); got {len(args.paths)}: "
                          f"{' '.join(args.paths) or '(none)'}")
    calibration = None
    if args.policy is not None:
        given = [flag for flag, value in (("--mode", args.mode), ("--preset", args.preset), ("--ratio", args.ratio),
                                          ("--keep-float", args.keep_float), ("--w4a4-scales", args.w4a4_scales))
                 if value]
        if given:
            raise LowBitError(f"--policy sets the whole policy; drop {', '.join(given)} (or edit the policy file)")
        from .quant.calibrate import load_policy_file

        policy, calibration = load_policy_file(args.policy)
        mode = policy.mode
    else:
        mode = args.mode or (DEMO_MODE if args.demo else None)
        if mode is None:
            raise LowBitError(f"quantize needs --mode MODE (one of: {', '.join(all_modes())}) or --policy FILE")
        if args.ratio is not None and mode != "int4_mixed":
            log.warning("--ratio only applies to --mode int4_mixed; ignored for %s", mode)
        ratio = {} if args.ratio is None else {"int4_mixed_ratio": args.ratio}
        scales = {} if args.w4a4_scales is None else {"w4a4_scales": args.w4a4_scales}
        policy = Policy(mode=mode, preset=args.preset or "auto", extra_keep_float=tuple(args.keep_float), **ratio,
                        **scales)
    compute_dtype = getattr(torch, DTYPES[args.dtype])
    device = resolve_device(args.device)

    out = Path(args.paths[-1])
    if args.demo:
        check_output_path(out, overwrite=args.overwrite, protect=(out.with_name(DEMO_SOURCE_NAME),))
        src = write_demo_source(out.with_name(DEMO_SOURCE_NAME), overwrite=args.overwrite)
    else:
        src = Path(args.paths[0])
        if not src.is_file():
            raise FileNotFoundError(f"input checkpoint not found: {src}" if not src.exists()
                                    else f"input {src} is not a file; pass a .safetensors checkpoint")
        check_output_path(out, overwrite=args.overwrite, protect=(src,))

    if args.print_plan:
        with open_checkpoint(src) as reader:
            print(policy.plan(reader.shapes()).table(), flush=True)
    log.info("quantizing %s -> %s (%s, preset %s, on %s)", src, out,
             f"policy {args.policy}" if args.policy else f"mode {mode}", policy.preset, device)
    with progress_bar(args, "quantizing", "tensor") as progress:
        if calibration is not None:
            # formats from the policy, plus the calibrated static FP8 input scales, the SmoothQuant
            # pre_quant_scales (smoothed weight + scale) for the formats the calibrating ComfyUI applied them to,
            # and the fp8_rowwise layers' outlier channels (weight [N, K + 2r] + weight_outlier_index)
            from .quant.calibration_apply import convert_calibrated

            report = convert_calibrated(src, out, policy, input_scales=calibration.input_scales(),
                                        pre_quant_scales=calibration.pre_quant_scales(),
                                        pre_quant_formats=calibration.config.pre_quant_formats,
                                        outlier_channels=calibration.outlier_channels(),
                                        calibration_summary=calibration.metadata_summary(),
                                        compute_dtype=compute_dtype, device=device, overwrite=args.overwrite,
                                        progress=progress)
        else:
            report = convert_file(src, out, policy, compute_dtype=compute_dtype, device=device,
                                  overwrite=args.overwrite, progress=progress)
    print(summary_table(out))
    fallbacks = report.plan.fallbacks()
    if fallbacks:
        log.info("%d layer(s) took a fallback format for their shape (--print-plan shows why)", len(fallbacks))
    log.info("%s", report.summary())
    return 0


def comfyui_path(given: str | None, command: str = "calibrate") -> Path:
    """Where ComfyUI is: ``--comfyui``, else ``$COMFYUI_PATH``, else ``~/ComfyUI``."""
    import os

    path = Path(given or os.environ.get("COMFYUI_PATH") or Path("~/ComfyUI").expanduser()).expanduser()
    if not (path / "comfy" / "sd.py").is_file():
        raise LowBitError(f"{command} runs the model with ComfyUI, which was not found at {path}; pass "
                          f"--comfyui PATH (a ComfyUI checkout) or set COMFYUI_PATH")
    return path


def import_comfyui(path: Path, device: str, command: str = "calibrate") -> None:
    """Make ComfyUI importable in this process, on ``device`` (``cpu`` or ``cuda``)."""
    if device not in ("cpu", "cuda"):
        raise LowBitError(f"{command} --device takes auto, cpu or cuda (ComfyUI picks the GPU), got {device!r}")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    import comfy.cli_args

    comfy.cli_args.args.cpu = device == "cpu"
    quiet = not log.isEnabledFor(logging.DEBUG)
    if quiet:  # ComfyUI reports its backends and devices on import; --debug shows it
        logging.disable(logging.INFO)
    try:
        import comfy.model_management  # noqa: F401
        import comfy.sd  # noqa: F401
    finally:
        if quiet:
            logging.disable(logging.NOTSET)


def checked_paths(src: str, out: str, overwrite: bool) -> tuple[Path, Path]:
    """``src`` (an existing file) and ``out`` (free, or ``overwrite``; never ``src``) as paths."""
    from .quant.safetensors_file import check_output_path

    src, out = Path(src), Path(out)
    if not src.is_file():
        raise FileNotFoundError(f"input checkpoint not found: {src}" if not src.exists()
                                else f"input {src} is not a file; pass a .safetensors checkpoint")
    check_output_path(out, overwrite=overwrite, protect=(src,))
    return src, out


def load_with_comfyui(src: Path, args: argparse.Namespace, command: str):
    """The diffusion model in ``src``, loaded by ComfyUI (``--comfyui``) on ``--device``."""
    device = resolve_device(args.device)
    import_comfyui(comfyui_path(args.comfyui, command), device, command)
    import comfy.sd

    log.info("loading %s with ComfyUI (%s)", src, device)
    return comfy.sd.load_diffusion_model(str(src))


def add_policy_options(parser: argparse.ArgumentParser, presets) -> None:
    """``--preset``, ``--ratio``, ``--keep-float`` and ``--w4a4-scales``: what a policy takes besides its mode."""
    parser.add_argument("--preset", default=None, choices=presets, metavar="PRESET",
                        help="architecture preset, one of: %(choices)s (default: auto = detect from the layer names)")
    parser.add_argument("--ratio", type=float, default=None, metavar="R",
                        help="int4_mixed only: share of quantized parameters kept in INT8 (0..1, default 0.2)")
    parser.add_argument("--keep-float", action="extend", nargs="+", default=[], metavar="REGEX",
                        help="extra layer-name regular expressions to keep in float (added to the preset's)")
    parser.add_argument("--w4a4-scales", choices=_LazyNames(_w4a4_scale_choices), default=None, metavar="SCALES",
                        help="how w4a4 weights' row scales are chosen, one of: %(choices)s. mse (the default): "
                             "searched per row, less error; absmax: comfy-kitchen's quantizer, bit for bit")


def cmd_calibrate(args: argparse.Namespace) -> int:

    from .quant.calibrate import CalibrationConfig

    src, out = checked_paths(args.file, args.policy_out, args.overwrite)
    config = CalibrationConfig(budget=args.budget, candidates=args.candidates, smoothing=args.smoothing,
                               rows_per_layer=args.rows, seed=args.seed)
    if args.steps < 1:
        raise LowBitError(f"--steps must be at least 1, got {args.steps}")
    model = load_with_comfyui(src, args, "calibrate")

    from .nodes.calibrate import calibrate_model

    with progress_bar(args, "measuring", "layer") as progress:
        result = calibrate_model(model, config, preset=args.preset, steps=args.steps, resolution=args.resolution,
                                 objective=args.objective, progress=progress)
    result.save(out, overwrite=args.overwrite)
    print(result.table() if args.layers else result.summary())
    log.info("wrote the policy to %s; quantize with: %s quantize %s OUT.safetensors --policy %s", out, PROG, src, out)
    return 0


def cmd_gptq(args: argparse.Namespace) -> int:
    from .quant.checkpoint import open_checkpoint
    from .quant.gptq import GPTQConfig
    from .quant.policy import Policy
    from .quant.quantize import gptq_problem

    src, out = checked_paths(args.file, args.out, args.overwrite)
    for value, flag in ((args.steps, "--steps"), (args.prompts, "--prompts")):
        if value < 1:
            raise LowBitError(f"{flag} must be at least 1, got {value}")
    if not args.hessian_budget_gb > 0:
        raise LowBitError(f"--hessian-budget-gb must be positive, got {args.hessian_budget_gb}")
    try:
        config = GPTQConfig(damp=args.damp)
    except ValueError as err:
        raise LowBitError(f"--damp: {err}") from None
    ratio = {} if args.ratio is None else {"int4_mixed_ratio": args.ratio}
    scales = {} if args.w4a4_scales is None else {"w4a4_scales": args.w4a4_scales}
    policy = Policy(mode=args.mode, preset=args.preset or "auto", extra_keep_float=tuple(args.keep_float), **ratio,
                    **scales)
    with open_checkpoint(src) as reader:  # refuse a plan GPTQ cannot round before loading the model
        problem = gptq_problem(d.format for d in policy.plan(reader.shapes()).quantized)
    if problem:
        raise LowBitError(f"gptq: {problem}")
    model = load_with_comfyui(src, args, "gptq")

    from .nodes.gptq import gptq_quantize_model
    from .nodes.model_quant import native_state_dict
    from .nodes.save import checkpoint_metadata
    from .quant.checkpoint import save_checkpoint

    with progress_bar(args, "GPTQ rounding", "layer") as progress:
        result = gptq_quantize_model(model, policy, steps=args.steps, prompts=args.prompts, resolution=args.resolution,
                                     seed=args.seed, gptq=config,
                                     hessian_budget_bytes=int(args.hessian_budget_gb * 2**30), progress=progress)
    save_checkpoint(native_state_dict(result), out, metadata=checkpoint_metadata(result, None),
                    overwrite=args.overwrite, protect=(src,))
    print(summary_table(out))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}" if not path.exists()
                                else f"{path} is not a file; pass a .safetensors checkpoint")
    from .quant.checkpoint import open_checkpoint
    from .quant.policy import Policy

    with open_checkpoint(path) as reader:
        quantized = reader.is_quantized
    if quantized:
        print(summary_table(path, per_layer=args.layers))
        return 0
    ratio = {} if args.ratio is None else {"int4_mixed_ratio": args.ratio}
    policy = Policy(mode=args.mode, preset=args.preset, **ratio)
    print(plan_table(path, policy, per_layer=args.layers))
    return 0


def write_demo_source(path: Path, *, overwrite: bool) -> Path:
    """Save the tiny Flux demo model at ``path``; an identical existing file is reused."""
    import torch

    from .quant.checkpoint import open_checkpoint, save_checkpoint
    from .quant.demo import tiny_flux_state_dict

    state_dict = tiny_flux_state_dict()
    if path.exists() and not overwrite:
        try:
            with open_checkpoint(path) as reader:
                same = reader.keys() == list(state_dict) and all(
                    torch.equal(reader.read(k), v) for k, v in state_dict.items())
        except LowBitError:
            same = False
        if not same:
            raise OutputExistsError(f"{path} exists and is not the demo model; the demo writes its float source "
                                    f"there. Move it away, or pass --overwrite to replace it.")
        log.info("reusing the demo model %s", path)
        return path
    save_checkpoint(state_dict, path, metadata={"lowbit_demo": "tiny_flux"}, overwrite=overwrite)
    log.info("wrote the demo model (tiny Flux architecture, random weights) to %s", path)
    return path


def resolve_device(name: str) -> str:
    """``auto`` → ``cuda`` when a GPU is usable, else ``cpu``; other names are checked."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LowBitError(f"--device {name!r} is not a device name; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LowBitError(f"--device {name}: no CUDA GPU is usable here; use --device cpu (or auto)")
    return str(device)


def cmd_bench(args: argparse.Namespace) -> int:
    module_name = f"{__package__}.kernels.bench"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise LowBitError("kernel benchmarks are not part of this install (kernels/bench.py is missing); "
                          "update LowBit to a version that ships them") from None
    return int(module.main(list(args.bench_args)) or 0)


# ---- parser ---------------------------------------------------------------------------------

def _all_modes() -> tuple[str, ...]:
    from .quant.policy import all_modes

    return all_modes()


def _w4a4_scale_choices() -> tuple[str, ...]:
    from .quant.policy import W4A4_SCALE_CHOICES

    return W4A4_SCALE_CHOICES


class _LazyNames(Sequence):
    """Choices loaded on first use: the mode list needs the format registry (torch and comfy-kitchen),
    which ``--help`` of most commands and ``formats``-free paths should not pay for until they use it."""

    def __init__(self, load):
        self._load = load
        self._names: tuple[str, ...] | None = None

    def _get(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = tuple(self._load())
        return self._names

    def __getitem__(self, index):
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, name: object) -> bool:
        return name in self._get()

    def __iter__(self):
        return iter(self._get())


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (exit code 2)."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("output control")
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of errors, and debug messages")
    group.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="only warnings and errors on stderr; no progress bar")
    return common


def build_parser() -> argparse.ArgumentParser:
    from .quant.presets import preset_names

    modes, presets = _LazyNames(_all_modes), ("auto", *preset_names())
    common = _common_options()
    parser = _Parser(prog=PROG, parents=[common], description=(
        "LowBit: quantize diffusion-model checkpoints (INT8 / FP8 / 4-bit) to ComfyUI-native files, "
        "inspect them, and list the formats."),
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command.")
    parser.set_defaults(func=None)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)

    q = sub.add_parser(
        "quantize", parents=[common], help="quantize a float .safetensors checkpoint (or the built-in demo)",
        usage=f"{PROG} quantize IN OUT --mode MODE [options]\n       {PROG} quantize --demo OUT [--mode MODE]",
        description="Quantize a float .safetensors diffusion model to a ComfyUI-native quantized checkpoint, "
                    "streaming one layer at a time. With --demo, build the small Flux-architecture demo model, "
                    f"save it as {DEMO_SOURCE_NAME} next to OUT, and quantize it.",
        epilog="A mode is a format (see 'lowbit formats') or a 4-bit mix: int4_mixed puts the most sensitive layers "
               "in int8_convrot (--ratio of the parameters) and the rest in w4a4; int4_full puts every quantizable "
               "layer in w4a4. Layers a format cannot take get its fallback format.")
    q.add_argument("paths", nargs="*", metavar="IN OUT", help="input checkpoint and output path (--demo: OUT only)")
    q.add_argument("--demo", action="store_true", help=f"quantize the built-in tiny Flux model (default mode {DEMO_MODE})")
    q.add_argument("--mode", choices=modes, metavar="MODE", help="one of: %(choices)s")
    q.add_argument("--policy", metavar="FILE",
                   help="a policy file (from 'lowbit calibrate', or a policy's JSON) instead of --mode/--preset/"
                        "--ratio/--keep-float; a calibrated one also gives FP8 layers their static input_scale, "
                        "smoothed layers their pre_quant_scale (the weight stored smoothed) and fp8_rowwise layers "
                        "their outlier channels")
    add_policy_options(q, presets)
    q.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="compute dtype handed to the format codecs (default bf16); today's formats store the same "
                        "bytes for every dtype, the run dtype is chosen when the model is loaded")
    q.add_argument("--device", default="auto",
                   help="where to quantize: auto (cuda when available, else cpu), cpu, cuda, cuda:1, ... ")
    q.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    q.add_argument("--print-plan", action="store_true", help="print the per-layer plan before converting")
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser(
        "calibrate", parents=[common], help="measure each layer's error per format and choose formats for a budget",
        usage=f"{PROG} calibrate IN POLICY_OUT --budget BUDGET [options]",
        description="Load the float checkpoint IN with ComfyUI, run a few real denoising steps on a stand-in text "
                    "embedding, measure every layer's output error under each candidate format, and write the policy "
                    "that fits BUDGET at the least total error to POLICY_OUT (JSON). Quantize with it: "
                    f"'{PROG} quantize IN OUT --policy POLICY_OUT'. Needs ComfyUI (--comfyui, $COMFYUI_PATH or "
                    "~/ComfyUI). For your own prompts, use the Calibrate Policy (LowBit) node.",
        epilog="BUDGET: the size of the whole diffusion model ('7GB', '6.5GiB', '7000000000' bytes), or 'ratio:R', the "
               "size int4_mixed takes with a share R of the quantized parameters in INT8.")
    c.add_argument("file", metavar="IN", help="a float .safetensors diffusion model")
    c.add_argument("policy_out", metavar="POLICY_OUT", help="where to write the policy file (.json)")
    c.add_argument("--budget", required=True, metavar="BUDGET", help="size budget: '7GB', '6.5GiB' or 'ratio:0.2'")
    c.add_argument("--candidates", default="w4a4,int8_convrot", metavar="LIST",
                   help="comma-separated formats a layer may take, or 'float' (default: %(default)s)")
    c.add_argument("--preset", default="auto", choices=presets, metavar="PRESET",
                   help="architecture preset, one of: %(choices)s (default: auto)")
    c.add_argument("--steps", type=int, default=4, help="denoising steps to record (default %(default)s)")
    c.add_argument("--resolution", type=int, default=512, metavar="PX",
                   help="side of the square calibration image in pixels (default %(default)s)")
    c.add_argument("--rows", type=int, default=256, metavar="N", help="input rows kept per layer (default %(default)s)")
    c.add_argument("--objective", choices=("model_output", "layer_output"), default="model_output",
                   help="model_output: replay the recorded steps once per layer and candidate with only that layer "
                        "quantized and minimise the summed model-output error; layer_output: minimise the layers' "
                        "own errors (faster). Default %(default)s")
    c.add_argument("--smoothing", choices=SMOOTHING_CHOICES, default="write",
                   help="write: measure SmoothQuant smoothing per layer and store a pre_quant_scale where it lowers "
                        "the layer's error by 5%% and its format may carry one (LowBit's own formats; a native format "
                        "only if this ComfyUI's loader applies it); measure: report the gain only; off: skip it "
                        "(faster). Default %(default)s")
    c.add_argument("--seed", type=int, default=0, help="seed of the noise, stand-in embedding and row sample")
    c.add_argument("--device", default="auto", help="where the model runs: auto, cpu or cuda")
    c.add_argument("--comfyui", metavar="PATH", help="ComfyUI checkout (default: $COMFYUI_PATH, else ~/ComfyUI)")
    c.add_argument("--layers", action="store_true", help="print the per-layer report, not only the summary")
    c.add_argument("--overwrite", action="store_true", help="replace POLICY_OUT if it exists")
    c.set_defaults(func=cmd_calibrate)

    g = sub.add_parser(
        "gptq", parents=[common], help="quantize with GPTQ rounding, calibrated on a few real denoising steps",
        usage=f"{PROG} gptq IN OUT --mode MODE [options]",
        description="Load the float checkpoint IN with ComfyUI, run a few real denoising steps on a stand-in text "
                    "embedding, and quantize it to OUT with each layer's codes chosen by GPTQ against its recorded "
                    "inputs (the int8, int8_convrot, fp8_rowwise, w4a4 and w4a8 layers; other formats round to nearest). "
                    "OUT is an ordinary file of those formats. Needs ComfyUI (--comfyui, $COMFYUI_PATH or "
                    "~/ComfyUI). For your own prompts, use the GPTQ Quantize Model (LowBit) node.")
    g.add_argument("file", metavar="IN", help="a float .safetensors diffusion model")
    g.add_argument("out", metavar="OUT", help="where to write the quantized checkpoint (.safetensors)")
    g.add_argument("--mode", required=True, choices=modes, metavar="MODE", help="one of: %(choices)s")
    add_policy_options(g, presets)
    g.add_argument("--steps", type=int, default=4, help="denoising steps to record (default %(default)s)")
    g.add_argument("--prompts", type=int, default=4,
                   help="stand-in text embeddings the steps run on, each its own seed (default %(default)s)")
    g.add_argument("--resolution", type=int, default=512, metavar="PX",
                   help="side of the square calibration image in pixels (default %(default)s)")
    g.add_argument("--damp", type=float, default=0.1,
                   help="added to each layer's Hessian diagonal, as a share of its mean: larger is closer to round to "
                        "nearest and safer on other prompts (default %(default)s; GPTQ's usual value is 0.01)")
    g.add_argument("--hessian-budget-gb", type=float, default=4.0, metavar="GB",
                   help="memory the layers' Hessians may take at once; the steps are replayed per group that fits "
                        "(default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the noise and the stand-in embedding")
    g.add_argument("--device", default="auto", help="where the model runs: auto, cpu or cuda")
    g.add_argument("--comfyui", metavar="PATH", help="ComfyUI checkout (default: $COMFYUI_PATH, else ~/ComfyUI)")
    g.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    g.set_defaults(func=cmd_gptq)

    i = sub.add_parser(
        "inspect", parents=[common], help="show the formats, layer counts and sizes of a checkpoint",
        description="For a quantized file: the stored format of every layer, layer counts and bytes per format. "
                    "For a float file: the plan --mode/--preset would apply and the bytes before (as bf16) and after.")
    i.add_argument("file", metavar="FILE", help="a .safetensors checkpoint")
    i.add_argument("--mode", choices=modes, default=DEMO_MODE, metavar="MODE",
                   help="float files: the mode to plan for (default %(default)s), one of: %(choices)s")
    i.add_argument("--preset", default="auto", choices=presets, metavar="PRESET",
                   help="float files: the preset to plan with (default %(default)s), one of: %(choices)s")
    i.add_argument("--ratio", type=float, default=None, metavar="R", help="float files, int4_mixed: the INT8 share")
    i.add_argument("--layers", action="store_true", help="also print one row per layer")
    i.set_defaults(func=cmd_inspect)

    f = sub.add_parser("formats", parents=[common], help="list the quantization formats",
                       description="The format registry: bits, activation scheme, native comfy_quant format, "
                                   "whether stock ComfyUI loads it, the GPU the fast path needs, and the fallback "
                                   "for layers a format cannot take.")
    f.add_argument("--markdown", action="store_true", help="print a Markdown table (as in README.md)")
    f.add_argument("--details", action="store_true",
                   help="print what each format is, the tensors it stores per layer and the input width it needs")
    f.set_defaults(func=cmd_formats)

    b = sub.add_parser("bench", parents=[common], help="benchmarks (bench kernels: GEMM kernel timings)",
                       description="Run a benchmark suite. 'bench kernels --help' lists the kernel benchmark's options.")
    b.add_argument("suite", choices=("kernels",), help="which benchmark: kernels")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the benchmark")
    b.set_defaults(func=cmd_bench)
    return parser


# ---- entry point ----------------------------------------------------------------------------

class _MessageFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


def _setup_logging(debug: bool, quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_MessageFormatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)
    if not debug:  # third-party chatter stays out of the CLI's output
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        _setup_logging(debug, getattr(args, "quiet", False))
        if args.func is None:
            build_parser().print_help(sys.stderr)
            return EXIT_USER_ERROR
        return args.func(args)
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except USER_ERRORS as err:
        if debug:
            log.exception("%s", err)
        message = " ".join(str(err).split()) or type(err).__name__
        sys.stderr.write(f"{PROG}: error: {message}\n")
        return EXIT_USER_ERROR
    except Exception as err:  # a bug: say so in one line unless --debug
        if debug:
            raise
        sys.stderr.write(f"{PROG}: unexpected error: {type(err).__name__}: {err} "
                         f"(run again with --debug for the traceback, and please report it)\n")
        return 1

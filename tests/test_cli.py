"""The ``lowbit`` command line, run the way users run it: ``python -m lowbit ...`` in a subprocess.

Every command shown in README.md, docs/cli.md and docs/formats.md is run here, in the order shown, in an
empty folder; the tables those files embed are checked against the format registry. Expected layer counts
come from the policy itself, and the written files are read back and compared with their source (SQNR).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_helpers import assert_state_dicts_bit_equal
from lowbit import cli
from lowbit.cli import format_details_markdown, formats_markdown
from lowbit.quant.checkpoint import load_quantized, open_checkpoint, save_checkpoint
from lowbit.quant.demo import TinyFluxConfig, flux_shapes, tiny_flux_state_dict
from lowbit.quant.formats import FORMATS
from lowbit.quant.policy import Policy, all_modes
from lowbit.quant.quantize import quantize_state_dict

REPO = Path(__file__).resolve().parents[1]
DOCS = {"README.md": REPO / "README.md", "docs/cli.md": REPO / "docs" / "cli.md",
        "docs/formats.md": REPO / "docs" / "formats.md"}
DEMO_OUT = "demo_int8_convrot.safetensors"
DEMO_SOURCE = "tiny_flux_bf16.safetensors"
TIMEOUT_S = 600
#: worst-layer SQNR (dB) a file written by the CLI must keep against its float source; the demo weights
#: have x8 outlier columns, which is what the rotated formats are for
MIN_SQNR_DB = {"int8_convrot": 35.0, "int8": 25.0, "fp8": 28.0, "w4a4": 14.0}


@dataclass(frozen=True)
class Run:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"lowbit {' '.join(self.args)} -> {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_cli(args, cwd: Path, timeout: float = TIMEOUT_S) -> Run:
    proc = subprocess.run([sys.executable, "-m", "lowbit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env())
    return Run(tuple(args), proc.returncode, proc.stdout, proc.stderr)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=_env())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    return env


def table_rows(text: str, first_header: str = "format") -> dict[str, dict[str, str]]:
    """Parse the first text table whose header starts with ``first_header``: {first cell: {column: cell}}."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith(first_header) and set(lines[i + 1]) <= {"-", " "} and lines[i + 1]:
            spans = [m.span() for m in re.finditer(r"-+", lines[i + 1])]
            headers = [line[a:b].strip() for a, b in spans]
            rows = {}
            for row in lines[i + 2:]:
                if not row.strip() or row.startswith(" "):
                    break
                cells = [row[a:(spans[j + 1][0] if j + 1 < len(spans) else None)].strip()
                         for j, (a, _) in enumerate(spans)]
                rows[cells[0]] = dict(zip(headers, cells))
            return rows
    raise AssertionError(f"no table with a {first_header!r} header in:\n{text}")


def layer_counts(text: str) -> dict[str, int]:
    """Layers per format from a report table (the 'total' and 'other tensors' rows left out)."""
    return {fmt: int(row["layers"]) for fmt, row in table_rows(text).items() if fmt not in ("total", "other tensors")}


def expected_counts(**policy) -> dict[str, int]:
    return Policy(**policy).plan(flux_shapes(TinyFluxConfig())).counts()


def worst_sqnr_db(quantized_file: Path, fmt: str) -> float:
    source = tiny_flux_state_dict()
    checkpoint = load_quantized(quantized_file)
    worst = float("inf")
    for name, weight in checkpoint.layers.items():
        if checkpoint.formats[name] != fmt:
            continue
        ref = source[f"{name}.weight"].float()
        err = weight.dequantize().float() - ref
        worst = min(worst, float(10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum())))
    assert worst != float("inf"), f"no {fmt} layer in {quantized_file}"
    return worst


# ---- documented commands -----------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n(?:\n?This prints `([^`]*)`)?", re.M | re.S)


def doc_examples(path: Path) -> list[tuple[str, object, str | None]]:
    """The runnable examples of a Markdown file, in order: ("cli", args, None) for each ``python -m lowbit``
    line of a ```bash block and ("python", code, expected stdout or None) for each ```python block."""
    out = []
    for lang, body, prints in FENCE.findall(path.read_text(encoding="utf-8")):
        if lang == "bash":
            for line in body.splitlines():
                if line.startswith("python -m lowbit "):
                    out.append(("cli", tuple(shlex.split(line)[3:]), None))
        elif lang == "python":
            out.append(("python", body, prints or None))
    return out


def run_in_process(args, cwd: Path) -> Run:
    """``lowbit.cli.main(args)`` in this process (what ``python -m lowbit`` calls), without its start-up cost."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {name: logging.getLogger(name).level for name in cli.QUIET_LOGGERS})
    stdout, stderr, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.main(list(args))
            except SystemExit as exit_:  # argparse's --help and usage errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
    return Run(tuple(args), code, stdout.getvalue(), stderr.getvalue())


def run_doc(name: str, folder: Path, *, subprocess_per_command: bool) -> list[tuple[tuple, Run]]:
    """Run a document's examples in order in ``folder``: each command as ``python -m lowbit`` in a subprocess,
    or (to save the start-up time of many processes) through ``lowbit.cli.main`` in this process."""
    results = []
    for kind, payload, prints in doc_examples(DOCS[name]):
        if kind == "cli":
            run = run_cli(payload, folder) if subprocess_per_command else run_in_process(payload, folder)
            assert run.returncode == 0, f"{name}: documented command failed\n{run}"
            results.append((payload, run))
        else:
            proc = run_python(payload, folder)
            assert proc.returncode == 0, f"{name}: documented Python example failed:\n{payload}\n{proc.stderr}"
            if prints is not None:
                assert proc.stdout.strip() == prints, f"{name}: the example printed {proc.stdout!r}, the text says {prints!r}"
    return results


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    return folder, run_doc("README.md", folder, subprocess_per_command=True)


def find_run(runs, *prefix: str) -> Run:
    for args, run in runs:
        if args[: len(prefix)] == prefix:
            return run
    raise AssertionError(f"no documented command starts with {' '.join(prefix)!r}: {[a for a, _ in runs]}")


def test_readme_first_command_is_the_demo(readme_runs):
    _, runs = readme_runs
    assert runs[0][0] == ("quantize", "--demo", DEMO_OUT)
    assert len(runs) >= 5, "README shows the CLI: quantize, inspect and formats"


def test_demo_writes_a_loadable_quantized_flux_file(readme_runs):
    folder, runs = readme_runs
    demo = find_run(runs, "quantize", "--demo")
    assert (folder / DEMO_SOURCE).is_file() and (folder / DEMO_OUT).is_file()
    assert layer_counts(demo.stdout) == expected_counts(mode="int8_convrot")
    with open_checkpoint(folder / DEMO_OUT) as reader:
        assert json.loads(reader.metadata["lowbit_policy"])["mode"] == "int8_convrot"
        assert json.loads(reader.metadata["lowbit_plan"])["preset"] == "flux1"
    assert worst_sqnr_db(folder / DEMO_OUT, "int8_convrot") > MIN_SQNR_DB["int8_convrot"]


def test_inspect_of_the_demo_shows_the_stored_formats(readme_runs):
    folder, runs = readme_runs
    inspect = find_run(runs, "inspect", DEMO_OUT)
    assert layer_counts(inspect.stdout) == expected_counts(mode="int8_convrot")
    rows = table_rows(inspect.stdout)
    assert rows["int8_convrot"]["after/before"] in ("50%", "51%", "52%")  # 8 bits + one fp32 scale per row


def test_inspect_plan_of_a_float_file_matches_the_conversion(readme_runs):
    """The plan `inspect` shows for a float file (counts and bytes) is what `quantize` then writes."""
    _, runs = readme_runs
    planned = table_rows(find_run(runs, "inspect", DEMO_SOURCE).stdout)
    written = table_rows(find_run(runs, "quantize", DEMO_SOURCE, "demo_int4_mixed.safetensors").stdout)
    assert planned == written


def test_quantize_int4_mixed_with_a_ratio(readme_runs):
    folder, runs = readme_runs
    run = find_run(runs, "quantize", DEMO_SOURCE, "demo_int4_mixed.safetensors")
    ratio = float(run.args[run.args.index("--ratio") + 1])
    counts = expected_counts(mode="int4_mixed", int4_mixed_ratio=ratio)
    assert counts.get("int8_convrot") and counts.get("w4a4"), "the demo ratio should give both formats"
    assert layer_counts(run.stdout) == counts
    assert worst_sqnr_db(folder / "demo_int4_mixed.safetensors", "w4a4") > MIN_SQNR_DB["w4a4"]
    assert worst_sqnr_db(folder / "demo_int4_mixed.safetensors", "int8_convrot") > MIN_SQNR_DB["int8_convrot"]


def test_quantize_fp8_keep_float_and_print_plan(readme_runs):
    folder, runs = readme_runs
    run = find_run(runs, "quantize", DEMO_SOURCE, "demo_fp8.safetensors")
    keep = run.args[run.args.index("--keep-float") + 1]
    assert "plan: mode=fp8" in run.stdout and "keep_float pattern" in run.stdout
    assert layer_counts(run.stdout) == expected_counts(mode="fp8", extra_keep_float=(keep,))
    source = tiny_flux_state_dict()
    checkpoint = load_quantized(folder / "demo_fp8.safetensors")
    kept = [k for k in source if re.search(keep, k[: -len(".weight")]) and k.endswith(".weight")]
    assert kept, f"--keep-float {keep!r} matches no layer of the demo model"
    for key in kept:
        assert key[: -len(".weight")] not in checkpoint.layers
        assert torch.equal(checkpoint.tensors[key], source[key])
    assert worst_sqnr_db(folder / "demo_fp8.safetensors", "fp8") > MIN_SQNR_DB["fp8"]


def test_formats_command_lists_the_registry(readme_runs):
    _, runs = readme_runs
    rows = table_rows(find_run(runs, "formats").stdout)
    assert list(rows) == list(FORMATS)
    for name, codec in FORMATS.items():
        assert rows[name]["comfy_quant format"] == codec.spec.native_format
        assert rows[name]["weight bits"] == str(codec.spec.weight_bits)
        assert rows[name]["fallback"] == (codec.spec.fallback or "-")
        assert rows[name]["stock ComfyUI loads"].startswith("yes" if codec.spec.stock_loadable else "no")


@pytest.mark.parametrize("doc", ["docs/cli.md", "docs/formats.md"])
def test_docs_examples_run(doc, tmp_path):
    runs = run_doc(doc, tmp_path, subprocess_per_command=False)
    assert runs, f"{doc} shows no runnable command"
    for args, run in runs:
        if "--quiet" in args or "-q" in args:
            assert run.stderr == "", f"--quiet still printed messages\n{run}"


def test_readme_and_docs_tables_match_the_registry():
    for name in ("README.md", "docs/formats.md"):
        assert _block(name, "formats-table") == formats_markdown(), \
            f"{name}'s formats table is stale: paste `python -m lowbit formats --markdown` between its markers"
    assert _block("docs/formats.md", "format-details") == format_details_markdown(), \
        "docs/formats.md's detail table is stale: paste `python -m lowbit formats --details --markdown` there"


def test_readme_has_exactly_one_test_command():
    block = _block("README.md", "test-command")
    commands = [line for line in block.splitlines() if line and not line.startswith("```")]
    assert commands == ["python -m pytest -q -n 2 --dist loadfile tests"], commands


def _block(name: str, marker: str) -> str:
    text = DOCS[name].read_text(encoding="utf-8")
    match = re.search(rf"<!-- lowbit:{marker}:begin -->\n(.*?)\n<!-- lowbit:{marker}:end -->", text, re.S)
    assert match, f"{name} has no lowbit:{marker} markers"
    return match.group(1).strip()


# ---- help and errors (independent commands, run side by side) ------------------------------------

QUICK = {
    "help": ["--help"],
    "help quantize": ["quantize", "--help"],
    "help inspect": ["inspect", "--help"],
    "help formats": ["formats", "--help"],
    "help bench": ["bench", "--help"],
    "no command": [],
    "missing input": ["quantize", "missing.safetensors", "out.safetensors", "--mode", "int8"],
    "missing input --debug": ["quantize", "missing.safetensors", "out.safetensors", "--mode", "int8", "--debug"],
    "existing output": ["quantize", "small.safetensors", "existing.safetensors", "--mode", "int8"],
    "unknown mode": ["quantize", "small.safetensors", "out.safetensors", "--mode", "int3"],
    "no mode": ["quantize", "small.safetensors", "out.safetensors"],
    "not safetensors": ["quantize", "notes.safetensors", "out.safetensors", "--mode", "int8"],
    "inspect missing": ["inspect", "missing.safetensors"],
    "already quantized": ["quantize", "quantized.safetensors", "out.safetensors", "--mode", "int8"],
    "bench kernels": ["bench", "kernels", "--help"],
    "w4a4 absmax": ["quantize", "small.safetensors", "absmax.safetensors", "--mode", "int4_full",
                    "--w4a4-scales", "absmax"],
    "bad w4a4 scales": ["quantize", "small.safetensors", "out.safetensors", "--mode", "w4a4", "--w4a4-scales", "max"],
    "policy and w4a4 scales": ["quantize", "small.safetensors", "out.safetensors", "--policy", "p.json",
                               "--w4a4-scales", "absmax"],
}
EXISTING = b"an earlier result that must survive"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quick")
    small = tiny_flux_state_dict(TinyFluxConfig(depth=1, depth_single_blocks=1))
    save_checkpoint(small, folder / "small.safetensors")
    weight = torch.ones(64, 64, dtype=torch.int8)
    save_checkpoint({"layer.weight": weight, "layer.weight_scale": torch.ones(64, 1),
                     "layer.comfy_quant": torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)},
                    folder / "quantized.safetensors")
    (folder / "existing.safetensors").write_bytes(EXISTING)
    (folder / "notes.safetensors").write_text("these are notes, not a checkpoint\n")
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = dict(zip(QUICK, pool.map(lambda args: run_cli(args, folder), QUICK.values())))
    return folder, runs


@pytest.mark.parametrize("name", [k for k in QUICK if k.startswith("help ")] + ["help"])
def test_help(quick, name):
    run = quick[1][name]
    assert run.returncode == 0, run
    assert run.stdout.startswith("usage: lowbit"), run


def test_help_lists_commands_modes_and_options(quick):
    runs = quick[1]
    for command in ("quantize", "inspect", "formats", "bench"):
        assert command in runs["help"].stdout
    help_quantize = " ".join(runs["help quantize"].stdout.split())
    for mode in all_modes():
        assert mode in help_quantize
    for option in ("--demo", "--mode", "--preset", "--ratio", "--keep-float", "--w4a4-scales", "--dtype", "--device",
                   "--overwrite", "--print-plan", "--debug"):
        assert option in help_quantize
    for option in ("--mode", "--preset", "--layers"):
        assert option in runs["help inspect"].stdout
    assert "--markdown" in runs["help formats"].stdout
    assert "kernels" in runs["help bench"].stdout


USER_ERROR_CASES = {
    "missing input": "missing.safetensors",
    "existing output": "--overwrite",
    "unknown mode": "int3",
    "no mode": "--mode",
    "not safetensors": "notes.safetensors",
    "inspect missing": "missing.safetensors",
    "already quantized": "already quantized",
    "no command": "",
    "bad w4a4 scales": "'max'",
    "policy and w4a4 scales": "drop --w4a4-scales",
}


@pytest.mark.parametrize("name", list(USER_ERROR_CASES))
def test_user_errors_exit_2_with_one_clear_line(quick, name):
    run = quick[1][name]
    assert run.returncode == 2, run
    assert "Traceback" not in run.stderr, run
    if name == "no command":
        assert "usage: lowbit" in run.stderr
        return
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("lowbit"), run
    assert USER_ERROR_CASES[name] in errors[0], run
    assert not (quick[0] / "out.safetensors").exists()


def test_w4a4_scales_option_is_the_policys(quick):
    folder, runs = quick
    assert runs["w4a4 absmax"].returncode == 0, runs["w4a4 absmax"]
    policy = Policy(mode="int4_full", w4a4_scales="absmax")
    loaded = load_quantized(folder / "absmax.safetensors")
    assert Policy.from_dict(json.loads(loaded.metadata["lowbit_policy"])) == policy
    expected, plan = quantize_state_dict(load_file(folder / "small.safetensors"), policy)
    assert any(d.format == "w4a4" for d in plan.quantized)
    assert_state_dicts_bit_equal(load_file(folder / "absmax.safetensors"), expected, "--w4a4-scales absmax")


def test_existing_output_is_left_unchanged(quick):
    folder, runs = quick
    assert runs["existing output"].returncode == 2
    assert (folder / "existing.safetensors").read_bytes() == EXISTING


def test_debug_shows_the_traceback(quick):
    run = quick[1]["missing input --debug"]
    assert run.returncode == 2 and "Traceback" in run.stderr, run


def test_bench_kernels_hook(quick):
    run = quick[1]["bench kernels"]
    if importlib.util.find_spec("lowbit.kernels.bench") is None:
        assert run.returncode == 2 and "kernels/bench.py is missing" in run.stderr, run
    else:
        assert run.returncode == 0 and "usage" in run.stdout.lower(), run


def test_readme_lists_every_node():
    """README's node table names every node class that nodes/__init__.py registers (read without ComfyUI)."""
    import ast

    tree = ast.parse((REPO / "nodes" / "__init__.py").read_text(encoding="utf-8"))
    registry = next(node.value for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
                    and getattr(node.target, "id", None) == "NODE_MODULES")
    classes = [name for names in ast.literal_eval(registry).values() for name in names]
    nodes = _block("README.md", "nodes")
    missing = [name for name in classes if f"`{name}`" not in nodes]
    assert classes and not missing, f"README's Nodes section lacks {missing}"

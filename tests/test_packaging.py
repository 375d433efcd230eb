"""Packaging: the Comfy Registry fields of pyproject.toml, requirements.txt, importing ``lowbit`` without
ComfyUI, ComfyUI's entry point, the CI script, and no machine-specific paths in what users read."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
REQUIREMENTS = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
REQUIREMENTS = [line for line in REQUIREMENTS if line]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def comfyui_path() -> Path:
    return Path(os.environ.get("COMFYUI_PATH") or Path.home() / "ComfyUI").expanduser()


def test_project_has_the_registry_fields():
    project = PYPROJECT["project"]
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,98}", project["name"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["description"].strip()
    license = project["license"]
    assert (isinstance(license, dict) and (license.get("text") or (REPO / license.get("file", "-")).is_file())), license
    assert project["dependencies"]
    urls = project["urls"]
    for key in ("Repository", "Documentation", "Issues"):
        assert urls[key].startswith("https://"), key


def test_tool_comfy_has_the_registry_fields():
    comfy = PYPROJECT["tool"]["comfy"]
    assert comfy["PublisherId"] and re.fullmatch(r"[a-z0-9-]+", comfy["PublisherId"])
    assert comfy["DisplayName"]
    icon = comfy["Icon"]
    assert icon.startswith("https://") and icon.endswith((".svg", ".png", ".jpg", ".gif"))
    in_repo = icon.split("/main/", 1)[1]  # the Icon URL serves a file of this repository's main branch
    assert (REPO / in_repo).is_file(), f"Icon points at {in_repo}, which the repository does not have"
    assert isinstance(comfy["includes"], list)
    for folder in comfy["includes"]:
        assert (REPO / folder).is_dir(), f"[tool.comfy] includes {folder!r}, which is not a folder of the repo"
    assert comfy["requires-comfyui"].startswith(">=0.30")


def test_version_agrees_with_the_package():
    import lowbit

    assert lowbit.__version__ == PYPROJECT["project"]["version"]


def test_comfyui_reads_the_node_configuration():
    """ComfyUI's own pyproject parser (comfy_config) accepts the file and sees the registry fields."""
    root = comfyui_path()
    if not (root / "comfy_config" / "config_parser.py").is_file():
        pytest.skip(f"ComfyUI not found at {root} (set COMFYUI_PATH)")
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from comfy_config.config_parser import extract_node_configuration as e;"
            "c = e(sys.argv[2]); print(c.project.name, c.tool_comfy.publisher_id, c.project.supported_comfyui_version,"
            " c.project.urls.repository, ','.join(c.tool_comfy.includes))")
    out = subprocess.run([sys.executable, "-c", code, str(root), str(REPO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name, publisher, comfyui, repository, includes = out.stdout.split()
    assert name == PYPROJECT["project"]["name"] and publisher == PYPROJECT["tool"]["comfy"]["PublisherId"]
    assert comfyui == PYPROJECT["tool"]["comfy"]["requires-comfyui"]
    assert repository == PYPROJECT["project"]["urls"]["Repository"]
    assert includes == ",".join(PYPROJECT["tool"]["comfy"]["includes"])


def test_requirements_are_torch_free_and_complete():
    names = {_name(r) for r in REQUIREMENTS}
    assert not names & {"torch", "torchvision", "torchaudio"}, "ComfyUI's own torch must be kept"
    assert {"comfy-kitchen", "packaging", "safetensors", "tqdm"} <= names
    kitchen = next(r for r in REQUIREMENTS if _name(r) == "comfy-kitchen")
    assert ">=0.2.27" in kitchen.replace(" ", "")
    project = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert names <= project, f"requirements.txt lists {sorted(names - project)} that pyproject does not"
    assert project - names <= {"torch"}, f"pyproject lists {sorted(project - names - {'torch'})} that requirements.txt lacks"


def test_test_extra_has_pytest():
    assert "pytest" in {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}


def test_import_lowbit_without_comfyui():
    """A clean interpreter (no ComfyUI on sys.path, no PYTHONPATH) imports the package, its core and CLI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COMFYUI"))}
    code = ("import sys, lowbit, lowbit.cli, lowbit.quant.formats, lowbit.quant.convert;"
            "assert not [m for m in sys.modules if m == 'comfy' or m.startswith(('comfy.', 'comfy_api'))], 'imported ComfyUI';"
            "print(lowbit.__version__)")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=Path.home(), env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PYPROJECT["project"]["version"]


def test_repo_root_exposes_comfy_entrypoint():
    """ComfyUI imports the folder's __init__.py and awaits ``comfy_entrypoint()``."""
    import inspect

    import lowbit

    assert inspect.iscoroutinefunction(lowbit.comfy_entrypoint)
    source = (REPO / "__init__.py").read_text(encoding="utf-8")
    assert re.search(r"^async def comfy_entrypoint\(", source, re.M)
    root = comfyui_path()
    if not (root / "comfy_api").is_dir():
        pytest.skip(f"ComfyUI not found at {root} (set COMFYUI_PATH): the extension itself is not built")
    code = ("import sys, asyncio; sys.path.insert(0, sys.argv[1]);"
            "import comfy.cli_args; comfy.cli_args.args.cpu = True;"
            "import lowbit; ext = asyncio.run(lowbit.comfy_entrypoint());"
            "from comfy_api.latest import ComfyExtension; assert isinstance(ext, ComfyExtension);"
            "nodes = asyncio.run(ext.get_node_list()); print(len(nodes))")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 1, "the extension lists no node"


def test_ci_script():
    script = REPO / ".ci" / "run"
    text = script.read_text(encoding="utf-8")
    assert script.stat().st_mode & stat.S_IXUSR, ".ci/run must be executable"
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    for needed in ("torch==2.14.1", "torchvision==0.29.1", "--no-deps torchaudio==2.11.1", 'pip install -q -e ".[test]"',
                   "COMFYUI_PATH", "lowbit:test-command:begin", 'comfy-kitchen==$KITCHEN_NEWEST',
                   'PYTHONPATH="$work/kitchen-newest'):
        assert needed in text, needed
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_ci_extracts_the_readme_test_command():
    """The lines of .ci/run that pick the test command out of README.md give exactly README's command."""
    text = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    extract = re.search(r"test_command=\$\((.*?)\)\n", text, re.S).group(1)
    out = subprocess.run(["bash", "-c", extract], cwd=REPO, capture_output=True, text=True, check=True)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- lowbit:test-command:begin -->")[1].split("<!-- lowbit:test-command:end -->")[0]
    assert out.stdout.strip() == "python -m pytest -q -n 2 --dist loadfile tests"
    assert out.stdout.strip() in block


MACHINE_PATHS = re.compile(r"(?<![\w.~])/(work|root|home/\w+|tmp)/")


@pytest.mark.parametrize("name", ["README.md", "docs/cli.md", "docs/formats.md", "cli.py", "__main__.py",
                                  "pyproject.toml", "requirements.txt", ".ci/run"])
def test_no_machine_paths(name):
    text = (REPO / name).read_text(encoding="utf-8")
    assert not MACHINE_PATHS.search(text), f"{name} names a machine path: {MACHINE_PATHS.search(text).group(0)}"


def test_every_package_folder_is_packaged():
    """Each folder of the repo with an __init__.py (tests aside) is a listed subpackage of ``lowbit``,
    and the presets are package data."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"lowbit": "."}
    listed = set(setuptools["packages"])
    for init in REPO.rglob("__init__.py"):
        folder = init.parent.relative_to(REPO)
        if folder.parts and folder.parts[0] in ("tests", "build", "dist") or any(p.startswith(".") for p in folder.parts):
            continue
        assert ".".join(("lowbit", *folder.parts)) in listed, f"{folder} is not in [tool.setuptools] packages"
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["lowbit"]
    assert any(list(REPO.glob(pattern)) for pattern in data if pattern.startswith("presets/"))
    assert PYPROJECT["project"]["scripts"]["lowbit"] == "lowbit.cli:main"

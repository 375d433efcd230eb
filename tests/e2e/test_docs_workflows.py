"""The example workflows in ``docs/workflows/`` load against the real server's node set, and are current."""

from __future__ import annotations

import json

import pytest

from docs_workflows import DOCS_DIR, WORKFLOWS, render
from ui_workflow import check_ui_workflow

FILES = sorted(DOCS_DIR.glob("*.json"))


@pytest.fixture(scope="module")
def object_info(comfy_server):
    return comfy_server.object_info()


def test_every_generated_workflow_is_committed():
    assert sorted(p.name for p in FILES) == sorted(f"{name}.json" for name in WORKFLOWS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workflow_parses_and_uses_only_known_nodes(path, object_info):
    workflow = json.loads(path.read_text(encoding="utf-8"))
    assert workflow["nodes"] and workflow["links"]
    problems = check_ui_workflow(workflow, object_info)
    assert not problems, "\n".join(problems)
    assert any(n["type"].startswith("LowBit") for n in workflow["nodes"])


def test_committed_workflows_match_the_generator(object_info):
    """A node that gained or lost an input would change the widget values: regenerate the docs then."""
    fresh = render(object_info)
    stale = [name for name, text in fresh.items() if (DOCS_DIR / name).read_text(encoding="utf-8") != text]
    assert not stale, f"{stale} are out of date: run python tests/e2e/docs_workflows.py"


def test_checker_catches_a_broken_workflow(object_info):
    workflow = json.loads(FILES[0].read_text(encoding="utf-8"))
    workflow["nodes"][0]["type"] = "NoSuchNode"
    workflow["nodes"][1]["widgets_values"] = workflow["nodes"][1]["widgets_values"] + ["extra"]
    problems = check_ui_workflow(workflow, object_info)
    assert any("NoSuchNode" in p for p in problems)
    assert any("widget values" in p for p in problems)

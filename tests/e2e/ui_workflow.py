"""Convert an API-format workflow to the UI (litegraph) format ComfyUI's front end loads, and check one.

The UI format lists ``nodes`` (each with its socket ``inputs``, ``outputs`` and ``widgets_values``)
and ``links`` (``[id, from_node, from_slot, to_node, to_slot, type]``). Which inputs are sockets and
which are widgets, and in what order widget values go, comes from the server's ``/object_info``:
widgets are the INT/FLOAT/STRING/BOOLEAN/COMBO inputs in ``input_order`` (required, then
optional), and an INT with ``control_after_generate`` (a seed) carries one extra value after it.
"""

from __future__ import annotations

from typing import Any, Mapping

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
COLUMN_WIDTH = 360
ROW_GAP = 40


def input_specs(node_info: Mapping) -> list[tuple[str, Any, dict, bool]]:
    """``(name, type, options, optional)`` of each visible input, in the order the UI shows them."""
    specs = []
    order = node_info.get("input_order") or {}
    for section in ("required", "optional"):
        inputs = node_info.get("input", {}).get(section, {}) or {}
        for name in order.get(section, list(inputs)):
            spec = inputs[name]
            kind = spec[0]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            specs.append((name, kind, options, section == "optional"))
    return specs


def is_widget(kind: Any, options: Mapping) -> bool:
    if options.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def socket_type(kind: Any) -> str:
    return "COMBO" if isinstance(kind, list) else str(kind)


def widget_count(node_info: Mapping) -> int:
    """How many ``widgets_values`` a node of this type carries."""
    return sum(1 + bool(opts.get("control_after_generate"))
               for _, kind, opts, _ in input_specs(node_info) if is_widget(kind, opts))


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def api_to_ui(api: Mapping[str, Mapping], object_info: Mapping[str, Mapping],
              titles: Mapping[str, str] | None = None) -> dict:
    """The UI-format workflow for an API-format one (node ids kept, laid out left to right)."""
    titles = titles or {}
    unknown = sorted({n["class_type"] for n in api.values()} - set(object_info))
    if unknown:
        raise ValueError(f"node types not in /object_info: {unknown}")
    ids = {key: int(key) for key in api}
    depth = _depths(api)
    links: list[list] = []
    outputs_links: dict[tuple[str, int], list[int]] = {}
    nodes = []
    column_y: dict[int, int] = {}
    for order, key in enumerate(sorted(api, key=lambda k: (depth[k], ids[k]))):
        node = api[key]
        info = object_info[node["class_type"]]
        inputs, widgets = [], []
        for name, kind, opts, optional in input_specs(info):
            value = node["inputs"].get(name)
            if is_widget(kind, opts):
                if _is_link(value):
                    raise ValueError(f"node {key}: widget input {name!r} fed by a link is not supported here")
                widgets.append(value if value is not None else _default(kind, opts))
                if opts.get("control_after_generate"):
                    widgets.append("fixed")
                continue
            link_id = None
            if _is_link(value):
                link_id = len(links) + 1
                source, slot = value
                out_type = object_info[api[source]["class_type"]]["output"][slot]
                links.append([link_id, ids[source], slot, ids[key], len(inputs), out_type])
                outputs_links.setdefault((source, slot), []).append(link_id)
            elif not optional:
                raise ValueError(f"node {key} ({node['class_type']}): required input {name!r} is not connected")
            inputs.append({"name": name, "type": socket_type(kind), "link": link_id})
        height = 70 + 26 * (len(inputs) + len(widgets) + len(info["output"]))
        column = depth[key]
        y = column_y.get(column, 60)
        column_y[column] = y + height + ROW_GAP
        entry = {
            "id": ids[key], "type": node["class_type"], "pos": [40 + column * COLUMN_WIDTH, y],
            "size": [320, height], "flags": {}, "order": order, "mode": 0,
            "inputs": inputs, "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widgets,
        }
        if key in titles:
            entry["title"] = titles[key]
        nodes.append(entry)
    by_id = {n["id"]: n for n in nodes}
    for key in api:
        info = object_info[api[key]["class_type"]]
        by_id[ids[key]]["outputs"] = [
            {"name": info.get("output_name", info["output"])[i], "type": out_type,
             "links": outputs_links.get((key, i), []), "slot_index": i}
            for i, out_type in enumerate(info["output"])
        ]
    return {
        "last_node_id": max(ids.values(), default=0), "last_link_id": len(links),
        "nodes": sorted(nodes, key=lambda n: n["id"]), "links": links, "groups": [], "config": {},
        "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}}, "version": 0.4,
    }


def check_ui_workflow(workflow: Mapping, object_info: Mapping[str, Mapping]) -> list[str]:
    """Everything in a UI-format workflow that the server's node set contradicts (empty: loads cleanly)."""
    problems = []
    nodes = {n["id"]: n for n in workflow.get("nodes", [])}
    for node in nodes.values():
        info = object_info.get(node["type"])
        if info is None:
            problems.append(f"node {node['id']}: type {node['type']!r} is not in /object_info")
            continue
        expected = widget_count(info)
        if len(node.get("widgets_values", [])) != expected:
            problems.append(f"node {node['id']} ({node['type']}): {len(node.get('widgets_values', []))} widget "
                            f"values, the node has {expected}")
        sockets = {name: socket_type(kind) for name, kind, opts, _ in input_specs(info) if not is_widget(kind, opts)}
        for inp in node.get("inputs", []):
            if inp["name"] not in sockets and "widget" not in inp:
                problems.append(f"node {node['id']} ({node['type']}): no input named {inp['name']!r}")
    for link_id, src, src_slot, dst, dst_slot, link_type in workflow.get("links", []):
        if src not in nodes or dst not in nodes:
            problems.append(f"link {link_id}: dangling ({src} -> {dst})")
            continue
        src_info, dst_node = object_info.get(nodes[src]["type"]), nodes[dst]
        if src_info is not None and src_info["output"][src_slot] != link_type:
            problems.append(f"link {link_id}: type {link_type} but {nodes[src]['type']} output {src_slot} is "
                            f"{src_info['output'][src_slot]}")
        target = dst_node["inputs"][dst_slot] if dst_slot < len(dst_node.get("inputs", [])) else None
        if target is None or target.get("link") != link_id:
            problems.append(f"link {link_id}: {dst_node['type']} input slot {dst_slot} does not point back to it")
        elif target["type"] not in (link_type, "*"):
            problems.append(f"link {link_id}: {link_type} into {dst_node['type']}.{target['name']} ({target['type']})")
    return problems


def _default(kind: Any, opts: Mapping) -> Any:
    if "default" in opts:
        return opts["default"]
    if isinstance(kind, list):
        return kind[0] if kind else ""
    if kind == "COMBO":
        return (opts.get("options") or [""])[0]
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(kind)


def _depths(api: Mapping[str, Mapping]) -> dict[str, int]:
    depth: dict[str, int] = {}

    def visit(key: str, stack: tuple = ()) -> int:
        if key in depth:
            return depth[key]
        if key in stack:
            raise ValueError(f"the workflow has a cycle through node {key}")
        parents = [v[0] for v in api[key]["inputs"].values() if _is_link(v)]
        depth[key] = 1 + max((visit(p, stack + (key,)) for p in parents), default=-1)
        return depth[key]

    for key in api:
        visit(key)
    return depth

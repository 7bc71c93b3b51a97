"""The drawing of the flow (``tools/docsgen/flow.py``) shows the flow its data says.

``problems`` reads the SVG as a browser would get it (XML, the SVG namespace)
and names what does not match ``flow.STEPS``: a label not drawn, a box
outside its actor's lane, an arrow that does not run from one step to the
next. The second half shows that each of those is caught.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tools.docsgen import flow

NS = {"svg": flow.SVG_NS}


def _box(root: ET.Element, index: int) -> tuple[float, float, float, float] | None:
    rect = root.find(f"svg:g[@id='step-{index}']/svg:rect", NS)
    if rect is None:
        return None
    x, y, w, h = (float(rect.get(k, "nan")) for k in ("x", "y", "width", "height"))
    return x, y, w, h


def _ends(d: str) -> tuple[tuple[float, float], tuple[float, float]]:
    words = d.replace("M", " ").replace("L", " ").split()
    numbers = [float(word) for word in words]
    return (numbers[0], numbers[1]), (numbers[-2], numbers[-1])


def problems(svg: str, steps: tuple[flow.Step, ...] = flow.STEPS) -> list[str]:
    """What the drawing gets wrong about ``steps`` (empty: nothing)."""
    root = ET.fromstring(svg)
    found: list[str] = []
    if root.tag != f"{{{flow.SVG_NS}}}svg":
        found.append(f"root is {root.tag}")
    if root.find("svg:script", NS) is not None or "<script" in svg:
        found.append("a script")
    for index, step in enumerate(steps):
        group = root.find(f"svg:g[@id='step-{index}']", NS)
        box = _box(root, index)
        if group is None or box is None:
            found.append(f"step {index}: no box")
            continue
        drawn = " ".join(span.text or "" for span in group.iterfind("svg:text/svg:tspan", NS))
        if drawn != step.label:
            found.append(f"step {index}: drawn {drawn!r}, not {step.label!r}")
        lane = root.find(f"svg:rect[@id='lane-{step.actor}']", NS)
        if lane is None:
            found.append(f"step {index}: no lane {step.actor}")
            continue
        left, width = float(lane.get("x", "nan")), float(lane.get("width", "nan"))
        x, _, w, _ = box
        if not (left <= x and x + w <= left + width):
            found.append(f"step {index}: box outside the {step.actor} lane")
    arrows = root.findall("svg:path[@marker-end]", NS)
    if len(arrows) != len(steps) - 1:
        found.append(f"{len(arrows)} arrows for {len(steps)} steps")
    for index in range(len(steps) - 1):
        path = root.find(f"svg:path[@id='arrow-{index}']", NS)
        here, there = _box(root, index), _box(root, index + 1)
        if path is None or here is None or there is None:
            found.append(f"arrow {index}: missing")
            continue
        (x0, y0), (x1, y1) = _ends(path.get("d", ""))
        if not (here[0] <= x0 <= here[0] + here[2] and y0 == here[1] + here[3]):
            found.append(f"arrow {index}: does not leave step {index}'s box")
        if not (there[0] <= x1 <= there[0] + there[2] and y1 == there[1]):
            found.append(f"arrow {index}: does not reach step {index + 1}'s box")
    return found


def test_the_drawing_shows_every_step_in_its_lane_with_arrows_between_them() -> None:
    assert problems(flow.render()) == []


def test_the_flow_names_every_part_and_the_real_names() -> None:
    assert {step.actor for step in flow.STEPS} == set(flow.ACTORS)
    labels = " ".join(step.label for step in flow.STEPS)
    for name in ("SIGTERM", "143", "jitckpt-agent", "staging/<id>/", "commit.json", "torn"):
        assert name in labels, name
    svg = flow.render()
    assert "checkpoint-&lt;step&gt;" in svg  # escaped, so that the file is XML
    assert "http://" not in svg.replace(flow.SVG_NS, "")  # nothing fetched from anywhere


def test_a_label_that_would_not_fit_a_box_is_wrapped_into_lines_that_do() -> None:
    for step in flow.STEPS:
        lines = flow.lines_of(step.label)
        assert " ".join(lines) == step.label
        assert all(len(line) <= flow.WRAP for line in lines), lines


def _edited(svg: str, index: int, *, dx: float = 0, text: str | None = None) -> str:
    """The drawing with step ``index``'s box moved by ``dx``, or its first line replaced."""
    ET.register_namespace("", flow.SVG_NS)
    root = ET.fromstring(svg)
    rect = root.find(f"svg:g[@id='step-{index}']/svg:rect", NS)
    span = root.find(f"svg:g[@id='step-{index}']/svg:text/svg:tspan", NS)
    assert rect is not None and span is not None
    rect.set("x", str(float(rect.get("x", "0")) + dx))
    if text is not None:
        span.text = text
    return ET.tostring(root, encoding="unicode")


def test_a_box_in_another_lane_a_lost_label_or_a_missing_arrow_is_caught() -> None:
    svg = flow.render()
    assert problems(_edited(svg, 2)) == []  # read and written again, nothing changed
    assert problems(_edited(svg, 2, dx=flow.LANE_WIDTH)) == [
        "step 2: box outside the trainer lane",
        "arrow 1: does not reach step 2's box",
        "arrow 2: does not leave step 2's box",
    ]
    [lost] = problems(_edited(svg, 0, text="Preemption"))
    assert lost.startswith('step 0: drawn "Preemption drain')
    assert problems(svg.replace('id="arrow-3"', 'id="arrow-x"')) == ["arrow 3: missing"]
    shorter = problems(flow.render(flow.STEPS[:-1]))
    assert shorter == ["step 10: no box", "9 arrows for 11 steps", "arrow 9: missing"]


def test_an_actor_with_no_lane_is_refused() -> None:
    with pytest.raises(ValueError, match="no lane"):
        flow.render((flow.Step("kubelet", "x"),))

"""One preemption, from the SIGTERM to the resume, as data, drawn as an SVG at every build.

The internals page and the home page describe in words how a preempted pod
saves and how the job's next pod resumes; a picture shows at a glance which
part does what, and in which order. It is kept here as data (``STEPS``, each
with the part that acts) beside the code that draws it, and the hook
(``hook.py``) writes ``assets/flow.svg`` into the site at every build: no
drawing stored in ``docs/`` to fall behind the words, and no JavaScript, no
diagram service, no network at build time (a plain SVG the page shows as an
image). The drawing has its own white background, so it reads the same in
the light and the dark theme. ``tests/docs/test_flow.py`` holds it to the
data: every label drawn, each box in its part's lane, an arrow from each step
to the next.
"""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass

# The parts that act, in lane order, left to right: key, lane title, box colours.
ACTORS: dict[str, tuple[str, str, str]] = {
    "kubernetes": ("Kubernetes", "#e8f0fe", "#3367d6"),
    "trainer": ("trainer (shim)", "#fef3e0", "#c26401"),
    "sidecar": ("sidecar (jitckpt-agent)", "#e6f4ea", "#188038"),
    "store": ("store (S3 or PVC)", "#f3e8fd", "#8430ce"),
}


@dataclass(frozen=True)
class Step:
    """One step of the flow: the part that acts, what it does, and a phase that begins with it."""

    actor: str
    label: str
    begins: str | None = None


STEPS: tuple[Step, ...] = (
    Step(
        "kubernetes",
        "Kueue preemption, a node drain or an eviction: SIGTERM, with the pod's grace period",
    ),
    Step("trainer", "SIGTERM sets the shim's flag; all ranks agree on one stop step"),
    Step("trainer", "at that step, the framework's own save writes checkpoint-<step>"),
    Step("trainer", "its files hard-linked into staging/<id>/, handed over: staged on agent.sock"),
    Step("trainer", "exit 143 once the sidecar owns the files: never a success"),
    Step("sidecar", "uploads the files, JIT first, then this node's manifest node-<k>.json"),
    Step("store", "checkpoint-<step>/ committed: commit.json written last"),
    Step(
        "kubernetes",
        "the job's controller creates a new pod (once Kueue admits the job again)",
        begins="the job's next pod",
    ),
    Step("kubernetes", "the jitckpt webhook injects it again: jitckpt-agent, shim, volumes"),
    Step(
        "sidecar",
        "restores the store's newest valid checkpoint (torn ones skipped) while the trainer starts",
    ),
    Step("trainer", "the shim resumes at the exact step, through the framework's own load"),
)

SVG_NS = "http://www.w3.org/2000/svg"
MARGIN = 16
LANE_WIDTH = 200
HEADER = 40  # the lane titles' row
BOX_INSET = 12  # between a box and its lane's sides
FONT = 12
LINE = 16  # one line of a box's text
PAD = 8  # above and below a box's text
WRAP = 25  # characters on one line of a box (about 160 px of a 12 px sans-serif)
GAP = 26  # between one box and the next: room for the arrow
PHASE_GAP = 56  # the same where a phase begins: the arrow, then the dashed line and its caption
INK = "#1f2328"
MUTED = "#57606a"
FONT_FAMILY = "Helvetica, Arial, sans-serif"


def lines_of(label: str) -> list[str]:
    """A label in lines that fit a box; joined with spaces they give the label again."""
    return textwrap.wrap(label, WRAP, break_long_words=False, break_on_hyphens=False)


def _lane_x(actor: str) -> int:
    return MARGIN + list(ACTORS).index(actor) * LANE_WIDTH


def _element(parent: ET.Element, tag: str, **attributes: object) -> ET.Element:
    return ET.SubElement(parent, tag, {k.replace("_", "-"): str(v) for k, v in attributes.items()})


def render(steps: tuple[Step, ...] = STEPS) -> str:
    """The flow as one self-contained SVG document: a lane per actor, a box per step, arrows."""
    unknown = sorted({step.actor for step in steps} - set(ACTORS))
    if unknown:
        raise ValueError(f"steps name actors with no lane: {unknown}")
    width = 2 * MARGIN + len(ACTORS) * LANE_WIDTH
    boxes: list[tuple[int, int, int, int]] = []  # x, y, width, height
    dividers: list[tuple[int, str]] = []  # y, caption
    y = MARGIN + HEADER + GAP // 2
    for step in steps:
        if step.begins is not None and boxes:
            y += PHASE_GAP - GAP
            dividers.append((y - GAP // 2 - 6, step.begins))
        height = 2 * PAD + LINE * len(lines_of(step.label))
        boxes.append((_lane_x(step.actor) + BOX_INSET, y, LANE_WIDTH - 2 * BOX_INSET, height))
        y += height + GAP
    lanes_bottom = y - GAP // 2
    total = lanes_bottom + MARGIN

    svg = ET.Element(
        "svg",
        {
            "xmlns": SVG_NS,
            "width": str(width),
            "height": str(total),
            "viewBox": f"0 0 {width} {total}",
            "role": "img",
            "aria-labelledby": "flow-title",
            "font-family": FONT_FAMILY,
            "font-size": str(FONT),
        },
    )
    title = _element(svg, "title", id="flow-title")
    title.text = "jitckpt: a preemption, from the SIGTERM to the resume at the same step"
    defs = _element(svg, "defs")
    marker = _element(
        defs,
        "marker",
        id="arrowhead",
        viewBox="0 0 10 10",
        refX=10,
        refY=5,
        markerWidth=7,
        markerHeight=7,
        orient="auto",
    )
    _element(marker, "path", d="M 0 0 L 10 5 L 0 10 z", fill=MUTED)
    _element(svg, "rect", x=0, y=0, width=width, height=total, rx=8, fill="#ffffff")

    for index, (actor, (name, _, _)) in enumerate(ACTORS.items()):
        x = _lane_x(actor)
        _element(
            svg,
            "rect",
            id=f"lane-{actor}",
            x=x,
            y=MARGIN,
            width=LANE_WIDTH,
            height=lanes_bottom - MARGIN,
            fill="#f6f8fa" if index % 2 == 0 else "#eef1f5",
            stroke="#d0d7de",
        )
        heading = _element(
            svg,
            "text",
            x=x + LANE_WIDTH // 2,
            y=MARGIN + HEADER // 2 + FONT // 2 - 1,
            text_anchor="middle",
            font_weight="bold",
            fill=INK,
        )
        heading.text = name

    for y_line, caption in dividers:
        _element(
            svg,
            "line",
            x1=MARGIN,
            y1=y_line,
            x2=width - MARGIN,
            y2=y_line,
            stroke=MUTED,
            stroke_dasharray="6 4",
        )
        text = _element(
            svg,
            "text",
            x=width - MARGIN - 8,
            y=y_line + FONT + 4,
            text_anchor="end",
            font_style="italic",
            fill=MUTED,
        )
        text.text = caption

    for index in range(len(steps) - 1):
        x0, y0, w0, h0 = boxes[index]
        x1, y1, w1, _ = boxes[index + 1]
        start_x, start_y = x0 + w0 // 2, y0 + h0
        end_x, end_y = x1 + w1 // 2, y1
        if start_x == end_x:
            d = f"M {start_x} {start_y} L {end_x} {end_y}"
        else:
            turn = start_y + min(14, (end_y - start_y) // 2)
            d = f"M {start_x} {start_y} L {start_x} {turn} L {end_x} {turn} L {end_x} {end_y}"
        _element(
            svg,
            "path",
            id=f"arrow-{index}",
            d=d,
            fill="none",
            stroke=MUTED,
            stroke_width="1.5",
            marker_end="url(#arrowhead)",
        )

    for index, (step, (x, y, w, h)) in enumerate(zip(steps, boxes, strict=True)):
        _, fill, stroke = ACTORS[step.actor]
        group = _element(svg, "g", id=f"step-{index}")
        tooltip = _element(group, "title")
        tooltip.text = f"{index + 1}. {ACTORS[step.actor][0]}: {step.label}"
        _element(group, "rect", x=x, y=y, width=w, height=h, rx=6, fill=fill, stroke=stroke)
        text = _element(group, "text", x=x + w // 2, text_anchor="middle", fill=INK)
        for number, line in enumerate(lines_of(step.label)):
            span = _element(text, "tspan", x=x + w // 2, y=y + PAD + LINE * number + FONT)
            span.text = line

    ET.indent(svg)
    for text in svg.iter("text"):  # no white space between a box's lines: it would be drawn
        if len(text):
            text.text = None
            for span in text:
                span.tail = None
    return ET.tostring(svg, encoding="unicode", xml_declaration=False) + "\n"

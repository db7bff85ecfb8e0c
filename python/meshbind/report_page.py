"""``meshbind check --html PATH``: the plan report as one self-contained page.

No network, no external script, style or font: the report's JSON sits in the page and a short
inline script draws the model tree (collapsed by layer index, each node coloured by the protocol
of its planned module, a parameter's placements and local shape shown on hover or click),
each rank's bytes as bars, each group of FSDP units with its dtypes and buffers, with
``--memory`` each class of ranks' step peak as a bar by kind, and with ``--step-time`` each
class's step as a bar of compute, the waits on each axis's collectives and the bubble.
"""

from __future__ import annotations

import html
import json
from importlib import resources

from meshbind.memory.result import StepMemory
from meshbind.report import PlanReport
from meshbind.steptime.result import StepTime


def page_asset(name: str) -> str:
    """A file of the pages' style or script, shipped in the package."""
    return resources.files("meshbind").joinpath(name).read_text(encoding="utf-8")


def report_page(report: PlanReport, title: str, memory: StepMemory | None = None, timed: StepTime | None = None) -> str:
    """The page: the report's JSON (and the step memory's and step time's, when traced), inline
    style and script, nothing fetched."""
    data = embedded_json(report.to_dict())
    memory_data = embedded_json(memory.to_dict() if memory is not None else None)
    time_data = embedded_json(timed.to_dict() if timed is not None else None)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{page_asset("report_page.css")}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<h2>Totals</h2><table id="totals"></table>
<h2>Bytes per rank</h2><div id="bars"></div>
<div id="units-section"><h2>FSDP units per rank</h2><table id="units"></table></div>
<div id="memory-section"><h2>One training step's peak per rank</h2><p id="memory-step"></p><div id="memory"></div></div>
<div id="time-section"><h2>One training step's time per rank</h2><p id="time-step"></p><div id="time"></div></div>
<h2>Model tree</h2><div id="legend"></div><div id="tree"></div>
<script type="application/json" id="report-data">{data}</script>
<script type="application/json" id="memory-data">{memory_data}</script>
<script type="application/json" id="time-data">{time_data}</script>
<script>{page_asset("report_page.js")}</script>
</body></html>
"""


def embedded_json(value: object) -> str:
    """``value`` as JSON that can sit inside a ``<script>`` element."""
    return json.dumps(value).replace("</", "<\\/")  # no "</script>" inside the data

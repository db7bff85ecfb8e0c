"""``meshbind plan --html PATH``: a layout search as one self-contained page.

Nothing fetched: the search's figures sit in the page and a short inline script draws every
layout that fits as a point of peak memory against tokens/s per GPU, the front of those no other
beats on both joined by a line, the device's memory as a line, the best layouts as a table with
the ``meshbind check`` command of each, and what fell out and why.
"""

from __future__ import annotations

import html
from typing import Any

from meshbind.report_page import embedded_json, page_asset
from meshbind.search.result import LayoutSearch


def search_page(search: LayoutSearch, title: str, top: int = 10) -> str:
    """The page of ``search``: every ranked layout as a point, the first ``top`` as table rows."""
    front = {id(c) for c in search.front()}
    points: list[dict[str, Any]] = []
    for candidate in search.ranked:
        assert candidate.layout is not None and candidate.memory is not None and candidate.time is not None
        points.append(
            {
                "layout": candidate.layout.text(),
                "peak_bytes": candidate.memory.peak_bytes,
                "tokens_per_second_per_gpu": candidate.time.tokens_per_second_per_gpu,
                "mfu": candidate.time.mfu,
                "step_s": candidate.time.step,
                "front": id(candidate) in front,
            }
        )
    data = {
        "heading": search.heading(),
        "device_memory": search.device_memory,
        "points": points,
        "top": top,
        "commands": list(search.commands[:top]),
        "left_out": search.refusals().most_common(),
    }
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{page_asset("report_page.css")}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p id="heading"></p>
<h2>Peak memory against speed</h2><div id="front"></div>
<h2>The best layouts</h2><table id="ranked"></table>
<h2>Left out</h2><table id="left-out"></table>
<script type="application/json" id="search-data">{embedded_json(data)}</script>
<script>{page_asset("search_page.js")}</script>
</body></html>
"""

"""The dashboard page: the live page the controller's API serves and the self-contained report
that `orchestrator report` and `simulate --plot X.html` write.

`static/` holds the page (dashboard.html, .js, .css) and the contract of the JSON it draws
(CONTRACT.md). This module reads no store and knows no server: the API and the simulator both
hand it their data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The dashboard page's assets (dashboard.html, .js, .css).
STATIC_DIR = Path(__file__).parent / "static"
#: What `dashboard_html` replaces to make a self-contained page.
CSS_TAG = '<link rel="stylesheet" href="static/dashboard.css">'
JS_TAG = '<script src="static/dashboard.js"></script>'
DATA_PLACEHOLDER = "<!--DASHBOARD_DATA-->"


def dashboard_html(data: dict[str, Any] | None = None) -> str:
    """The dashboard page: live (assets under `static/`, data polled), or with `data`
    (`{"fleet": ..., "job": ...}`) a self-contained page with assets and data inlined."""
    page = (STATIC_DIR / "dashboard.html").read_text()
    if data is None:
        return page
    css = (STATIC_DIR / "dashboard.css").read_text()
    js = (STATIC_DIR / "dashboard.js").read_text()
    # "</" inside the JSON must not end the script element early
    embedded = json.dumps(data).replace("</", "<\\/")
    for tag, inline in (
        (CSS_TAG, f"<style>\n{css}\n</style>"),
        (JS_TAG, f"<script>\n{js}\n</script>"),
        (DATA_PLACEHOLDER,
         f'<script id="dashboard-data" type="application/json">{embedded}</script>'),
    ):  # fmt: skip
        if page.count(tag) != 1:
            raise RuntimeError(f"dashboard.html must hold {tag!r} exactly once")
        page = page.replace(tag, inline)
    return page

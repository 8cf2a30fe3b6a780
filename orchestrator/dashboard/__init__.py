"""The dashboard page and its assets (`page.py`, `static/`)."""

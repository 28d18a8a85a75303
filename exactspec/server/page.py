"""The live page's files (``page/``), served at ``/`` and ``/page/NAME``: open without the API key (they hold no data;
the page asks for the key), under a policy that lets it load nothing but the server's own."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import FileResponse

from exactspec.server.protocol import ApiError

PAGE = Path(__file__).with_name("page")  # the live page: one HTML file, its CSS and its script
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.css": "text/css; charset=utf-8",
              "page.js": "text/javascript; charset=utf-8"}
PAGE_PATHS = {"/", *(f"/page/{name}" for name in PAGE_FILES if name != "index.html")}  # open without the key
PAGE_HEADERS = {  # nothing from elsewhere: no script, style, image or connection but the server's own
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def page_file(name: str) -> FileResponse:
    """One of the page's files, or 404."""
    if name not in PAGE_FILES:
        raise ApiError(f"the page has no file {name!r}", status=404)
    return FileResponse(PAGE / name, media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

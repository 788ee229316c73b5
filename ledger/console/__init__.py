"""The reviewer console: ``/console`` on ``ledger serve`` (server-rendered pages, local
assets only), plus Swagger UI at ``/docs`` from vendored files (no CDN).

:func:`mount` is the one call the app factory makes.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI) -> None:
    """Add the console's routes, its static files and the local Swagger UI to ``app``."""
    from ledger.console.routes import router

    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API docs",
            swagger_js_url="/console/static/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/console/static/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/console/static/swagger-ui/favicon-32x32.png")

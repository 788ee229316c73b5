"""The REST API (FastAPI). Never imports torch."""

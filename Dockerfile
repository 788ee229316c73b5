# Image for the API, beat and (with a CUDA base and torch) the worker.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY ledger ledger
COPY workers workers
COPY migrations migrations
RUN pip install --no-cache-dir '.[replay]'
ENTRYPOINT []

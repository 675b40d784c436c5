FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY marbles_rq ./marbles_rq
COPY lua ./lua
RUN pip install --no-cache-dir . && useradd --create-home marbles
USER marbles
ENTRYPOINT []

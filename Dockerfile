FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY marbles_rq ./marbles_rq
COPY lua ./lua
COPY ops/redis.conf ./ops/redis.conf
RUN pip install --no-cache-dir . && useradd --create-home marbles
USER marbles
ENTRYPOINT []

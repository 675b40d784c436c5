FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY marbles_rq ./marbles_rq
COPY lua ./lua
COPY ops/redis.conf ./ops/redis.conf
RUN pip install --no-cache-dir . && useradd --create-home marbles
USER marbles
# Healthy while this container's worker or controller is (marbles_rq/cli/health.py): a worker
# registered with RQ from this host, or a controller that leads or waits while another leads.
# compose.yaml gives each service its own check, which replaces this one.
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s --retries=3 \
    CMD marbles-rq health worker >/dev/null 2>&1 || marbles-rq health controller
ENTRYPOINT []

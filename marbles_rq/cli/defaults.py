"""The store's defaults and variable names as the command line spells them, so that
`--version`, `--help` and completion need not import the store (and redis, which costs
more than all the rest); tests/test_cli_startup.py checks they match store.connection,
store.keys and engine.authoring."""

URL_ENV = "MARBLES_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "mrq"
DEFAULT_BUCKETS = 1024
SOURCE_ENV = "MARBLES_SOURCE"
COMPLETE_ENV = "_MARBLES_RQ_COMPLETE"  # click's completion protocol for prog marbles-rq

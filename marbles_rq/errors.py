"""Every error marbles-rq raises on purpose: one class per condition, each with a stable code."""

from __future__ import annotations


class MarblesError(Exception):
    """Base class. `code` is stable and machine-readable; str(error) is one human line."""

    code = "error"


class ConfigError(MarblesError):
    """A setting is malformed (a Redis URL, a prefix, a bucket count)."""

    code = "config"


class RedisUnavailableError(MarblesError):
    """Redis could not be reached, refused our credentials, or timed out."""

    code = "redis_unavailable"


class UnsafeRedisError(MarblesError):
    """Redis is configured so that an acknowledged write could be lost or evicted."""

    code = "unsafe_redis"


class BucketMismatchError(MarblesError):
    """This deployment was created with another bucket count; keys would not be found."""

    code = "bucket_mismatch"


class GrowInProgressError(BucketMismatchError):
    """The deployment's bucket count is being grown; only `buckets grow` may run."""

    code = "grow_in_progress"


class InvalidIdError(MarblesError):
    """An id, kind or name does not match its allowed pattern."""

    code = "invalid_id"


class CorruptRecordError(MarblesError):
    """A stored document is not valid JSON for its record type."""

    code = "corrupt_record"

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt record at {key}: {reason}")
        self.key = key
        self.reason = reason


class UnsupportedRecordVersionError(MarblesError):
    """A record was written by a newer marbles-rq; decoding it here would lose fields."""

    code = "unsupported_record_version"

    def __init__(self, key: str, version: int, supported: int) -> None:
        super().__init__(
            f"record at {key} has version {version}; this marbles-rq reads up to {supported}"
        )
        self.key = key


class AgentIdTakenError(MarblesError):
    """Provisioning asked for an agent id that another provisioning key already owns."""

    code = "agent_id_taken"


class ScriptReplyError(MarblesError):
    """A Lua script answered with something its header does not document (a bug)."""

    code = "script_reply"


class RunSettledError(MarblesError):
    """An operation that needs an unfinished run (pause, resume, signal) found it finished."""

    code = "run_settled"

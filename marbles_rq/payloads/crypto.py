"""Sealing payloads at rest: zstd compression, then AES-256-GCM under the deployment's keys.

Keys: ``MARBLES_KEYS=k2:<base64 of 32 bytes>,k1:<base64 of 32 bytes>``. The first key
seals every new payload; every listed key opens. Rotation without downtime: add the new
key second on every process, then move it first, then (once nothing sealed with the old
one is kept) drop the old one (docs/how-to/encryption.md). A malformed value is a
`ConfigError` of one line, raised when the process first seals or opens (its start: the
worker and the controller check it as they start, through `check_config`).

Compression (``MARBLES_COMPRESS``): ``auto`` (the default) compresses a payload of at least
``COMPRESS_MIN`` bytes when zstd makes it smaller, and only when it is encrypted anyway (an
unencrypted payload is then stored as given: base64 would cost a third of what zstd saves,
and plain tools can read it); ``zstd``: the same rule for unencrypted payloads too (when
the compressed base64 is smaller); ``off``: never.

The JSON envelope of a sealed payload::

    {"$mr":"enc","k":"<key id>","z":1,"d":"<base64 of nonce(12) + ciphertext+tag>"}

``k`` is absent when only compressed (then ``d`` is the compressed bytes), ``z`` is 0 or 1.
The GCM associated data binds the envelope's version, key id and compression flag
(``mr1|<k>|<z>``), so an envelope whose ``k`` or ``z`` was altered does not open. It does
not bind the payload's place (a run, a field): the codec is not told where a payload is read
from, and a rerun copies sealed ledger entries as they are.

Binary content (`seal_bytes`, artifact blobs) is framed, not base64'd::

    b"MRS1" + flags(1: bit 0 zstd, bit 1 encrypted) + len(key id)(1) + key id
           + (nonce(12) + ciphertext+tag | the compressed or plain bytes)

Content that is neither encrypted nor compressed is stored as is, unless it begins with the
magic (then framed with flags 0), so `open_bytes` tells the two apart."""

from __future__ import annotations

import base64
import binascii
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ConfigError, MarblesError

KEYS_ENV = "MARBLES_KEYS"
COMPRESS_ENV = "MARBLES_COMPRESS"
COMPRESS_MIN = 512  # bytes: below this zstd's frame costs about what it saves
VERSION = b"mr1"
MAGIC = b"MRS1"
NONCE = 12


class PayloadKeyMissing(ConfigError):
    """A payload was sealed under a key this process's MARBLES_KEYS does not hold (this
    process's configuration lacks it: the CLI exits 2, the HTTP API answers 409)."""

    code = "key_missing"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"payload encrypted with key '{key_id}', which {KEYS_ENV} "
                         f"does not hold")
        self.key_id = key_id


class PayloadSealError(MarblesError):
    """A sealed payload that does not open (altered, or a key of the same id but other bytes)."""

    code = "payload_unreadable"


class Envelope(msgspec.Struct, omit_defaults=True):
    d: str
    k: str = ""
    z: int = 0


@dataclass(frozen=True)
class Config:
    keys: dict[str, bytes]  # id -> 32 bytes; insertion order: the first seals
    compress: str  # auto | zstd | off

    @property
    def sealing_key(self) -> str:
        return next(iter(self.keys), "")

    @property
    def active(self) -> bool:
        """Whether the codec changes anything (keys, or compression asked for)."""
        return bool(self.keys) or self.compress == "zstd"


def parse_keys(text: str) -> dict[str, bytes]:
    """``id:base64,...`` -> {id: key}; ConfigError (one line) on anything malformed."""
    keys: dict[str, bytes] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key_id, sep, b64 = part.partition(":")
        key_id = key_id.strip()
        if not sep or not key_id:
            raise ConfigError(f"{KEYS_ENV}: '{_redact(part)}' is not <id>:<base64 key>")
        if len(key_id) > 64 or not all(c.isalnum() or c in "-_." for c in key_id):
            raise ConfigError(f"{KEYS_ENV}: key id '{key_id[:64]}' must be letters, digits, "
                              f"'-', '_' or '.' (64 at most)")
        try:
            raw = base64.b64decode(b64.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{KEYS_ENV}: key '{key_id}' is not valid base64") from None
        if len(raw) != 32:
            raise ConfigError(f"{KEYS_ENV}: key '{key_id}' is {len(raw)} bytes, not 32 "
                              f"(AES-256: `openssl rand -base64 32` makes one)")
        if key_id in keys:
            raise ConfigError(f"{KEYS_ENV}: key id '{key_id}' is listed twice")
        keys[key_id] = raw
    if text.strip() and not keys:
        raise ConfigError(f"{KEYS_ENV} is set but lists no key")
    return keys


def _redact(part: str) -> str:
    return part if len(part) <= 12 else part[:8] + "..."


_cache: tuple[tuple[str, str], Config] | None = None
_lock = threading.Lock()


def config() -> Config:
    """This process's sealing configuration, read from the environment (again when it
    changes: a test, or a process that sets it before its first payload)."""
    global _cache
    env = (os.environ.get(KEYS_ENV, ""), os.environ.get(COMPRESS_ENV, "auto"))
    found = _cache
    if found is not None and found[0] == env:
        return found[1]
    with _lock:
        compress = env[1].strip().lower() or "auto"
        if compress not in ("auto", "zstd", "off"):
            raise ConfigError(f"{COMPRESS_ENV}={env[1]!r}: expected auto, zstd or off")
        made = Config(parse_keys(env[0]), compress)
        _cache = (env, made)
        return made


def check_config() -> None:
    """Raise the ConfigError of a malformed MARBLES_KEYS / MARBLES_COMPRESS now."""
    config()


def generate_key() -> str:
    """A new key, base64 (32 random bytes)."""
    return base64.b64encode(os.urandom(32)).decode()


# -- the primitives ------------------------------------------------------------------------

_local = threading.local()


def _compress(data: bytes) -> bytes:
    comp = getattr(_local, "comp", None)
    if comp is None:
        import zstandard

        comp = _local.comp = zstandard.ZstdCompressor(level=3)
    return comp.compress(data)


def _decompress(data: bytes) -> bytes:
    import zstandard

    dec = getattr(_local, "dec", None)
    if dec is None:
        dec = _local.dec = zstandard.ZstdDecompressor()
    try:
        return dec.decompress(data)
    except zstandard.ZstdError as exc:
        raise PayloadSealError(f"a compressed payload does not decompress: {exc}") from None


def _aad(key_id: str, z: int) -> bytes:
    return VERSION + b"|" + key_id.encode() + b"|" + str(z).encode()


@functools.lru_cache(maxsize=16)
def _cipher(key: bytes) -> Any:
    """The AES-GCM object of a key (its key schedule computed once per process)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _encrypt(key: bytes, key_id: str, z: int, data: bytes) -> bytes:
    nonce = os.urandom(NONCE)
    return nonce + bytes(_cipher(key).encrypt(nonce, data, _aad(key_id, z)))


def _decrypt(cfg: Config, key_id: str, z: int, blob: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag

    key = cfg.keys.get(key_id)
    if key is None:
        raise PayloadKeyMissing(key_id)
    try:
        return bytes(_cipher(key).decrypt(blob[:NONCE], blob[NONCE:], _aad(key_id, z)))
    except InvalidTag:
        raise PayloadSealError(f"a payload sealed with key '{key_id}' does not open: altered, "
                               f"or {KEYS_ENV} holds another key under that id") from None


def _maybe_compress(cfg: Config, data: bytes, *, encrypted: bool) -> tuple[int, bytes]:
    if cfg.compress == "off" or len(data) < COMPRESS_MIN:
        return 0, data
    if cfg.compress == "auto" and not encrypted:
        return 0, data
    packed = _compress(data)
    return (1, packed) if len(packed) < len(data) else (0, data)


# -- JSON payloads -------------------------------------------------------------------------

_envelope = msgspec.json.Decoder(Envelope)


def seal_json(data: bytes) -> bytes | None:
    """The envelope of the JSON text `data`, or None when it is stored as given."""
    cfg = config()
    if not cfg.active:
        return None
    key_id = cfg.sealing_key
    z, body = _maybe_compress(cfg, data, encrypted=bool(key_id))
    if key_id:
        body = _encrypt(cfg.keys[key_id], key_id, z, body)
    elif not z or len(body) * 4 // 3 + 40 >= len(data):
        return None  # compression alone that does not pay for its base64
    d = base64.b64encode(body)
    head = b'{"$mr":"enc",' + (b'"k":' + msgspec.json.encode(key_id) + b"," if key_id else b"")
    return head + b'"z":' + str(z).encode() + b',"d":"' + d + b'"}'


def open_json(stored: bytes) -> bytes:
    """The JSON text a ``{"$mr":"enc",...}`` envelope holds."""
    try:
        env = _envelope.decode(stored)
        body = base64.b64decode(env.d, validate=True)
    except (msgspec.DecodeError, binascii.Error, ValueError) as exc:
        raise PayloadSealError(f"a sealed payload's envelope is unreadable: {exc}") from None
    if env.k:
        body = _decrypt(config(), env.k, env.z, body)
    return _decompress(body) if env.z else body


# -- binary content ------------------------------------------------------------------------

def seal_blob(data: bytes) -> bytes:
    cfg = config()
    key_id = cfg.sealing_key if cfg.keys else ""
    z, body = _maybe_compress(cfg, data, encrypted=bool(key_id)) if cfg.active else (0, data)
    if key_id:
        body = _encrypt(cfg.keys[key_id], key_id, z, body)
    elif not z and not data.startswith(MAGIC):
        return data
    kid = key_id.encode()
    return MAGIC + bytes([z | (2 if key_id else 0), len(kid)]) + kid + body


def open_blob(sealed: bytes) -> bytes:
    if not sealed.startswith(MAGIC):
        return sealed
    if len(sealed) < len(MAGIC) + 2:
        raise PayloadSealError("a sealed blob is truncated")
    flags, n = sealed[4], sealed[5]
    key_id = sealed[6:6 + n].decode()
    body = sealed[6 + n:]
    z = flags & 1
    if flags & 2:
        body = _decrypt(config(), key_id, z, body)
    return _decompress(body) if z else body

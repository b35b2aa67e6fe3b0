"""The side channel's authentication: every message sealed with an HMAC-SHA256 under a shared key.

The two engines share the key (docs/transfer.md: The side channel's key).

A sealed message is one JSON object (canonical: sorted keys, no spaces) of its kind, the
sender's identity, a fresh nonce, the time it was sealed, the payload (base64) and, when the
reply answers a request, the request's nonce; the MAC covers exactly those bytes, prefixed
by a domain tag, and travels after them. :meth:`Opener.open` refuses a message whose MAC
does not verify (no key, another key, a changed byte), whose kind is not the one expected
(a notification replayed as a hello), that is older than ``max_age`` seconds or from the
future, whose nonce it has seen before (a replay), or that answers another request. Every
refusal is a :class:`DCPAuthError` naming the reason; the receiver logs and counts it.

The key: ``DCP_KV_KEY`` (at least 32 characters) or ``DCP_KV_KEY_FILE`` (a file of at least
32 bytes, readable by its owner only), or ``key=`` in code. Without one an engine refuses to
start, unless ``insecure=True`` (or ``DCP_KV_INSECURE=1``) asks for the explicit insecure
local mode: messages then carry no MAC, none is checked, and a warning says so.
"""

from __future__ import annotations

import base64
import collections
import enum
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass

from dcp_compile.runtime.errors import DCPTransferError

log = logging.getLogger(__name__)

KEY_ENV = "DCP_KV_KEY"
KEY_FILE_ENV = "DCP_KV_KEY_FILE"
INSECURE_ENV = "DCP_KV_INSECURE"
MIN_KEY_BYTES = 32
MAX_AGE = 30.0            # seconds a sealed message stays acceptable (and its nonce remembered)
FUTURE_SKEW = 5.0         # seconds a sender's clock may run ahead
_DOMAIN = b"dcp-kv-side-channel/1\0"
_SEAL_VERSION = 1
# The fields of a sealed message and their types (rules as data; "reply_to" may be null).
ENVELOPE = {"v": int, "kind": str, "sender": str, "nonce": str, "time": float,
            "payload": str, "reply_to": (str, type(None))}


class MessageKind(enum.StrEnum):
    """The side channel's messages (the MAC covers the kind: one cannot pass for another)."""

    HELLO = "hello"                 # decode -> prefill: asks for the agent metadata
    METADATA = "metadata"           # prefill -> decode: the agent metadata, answering a hello
    NOTIFICATION = "notification"   # decode -> prefill over NIXL: a request's blocks were read


class DCPAuthError(DCPTransferError):
    """A side-channel message was refused: forged, tampered, replayed, stale or unsigned."""


@dataclass(frozen=True)
class SideChannelKey:
    """The key the engines share (``None`` bytes: the explicit insecure local mode)."""

    secret: bytes | None
    origin: str                     # where it came from, for messages (never the key)

    @property
    def insecure(self) -> bool:
        return self.secret is None


def load_key(key: "bytes | str | SideChannelKey | None" = None, *, insecure: bool = False,
             who: str = "this engine") -> SideChannelKey:
    """The side channel's key: ``key`` if given, else ``DCP_KV_KEY``, else the file
    ``DCP_KV_KEY_FILE``; with none, the insecure local mode if ``insecure`` (or
    ``DCP_KV_INSECURE=1``) asks for it (logged as a warning), else a DCPAuthError."""
    if isinstance(key, SideChannelKey):
        return key
    if key is not None:
        return _checked(key.encode() if isinstance(key, str) else bytes(key), "key=", who)
    if os.environ.get(KEY_ENV):
        return _checked(os.environ[KEY_ENV].encode(), f"${KEY_ENV}", who)
    if os.environ.get(KEY_FILE_ENV):
        path = os.environ[KEY_FILE_ENV]
        try:
            mode = os.stat(path).st_mode
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise DCPAuthError(f"{who}: the side channel's key file {path} (${KEY_FILE_ENV}) "
                               f"cannot be read: {e}. Point {KEY_FILE_ENV} at a readable "
                               f"file.") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise DCPAuthError(f"{who}: the side channel's key file {path} is readable by "
                               f"others (mode {stat.filemode(mode)}). chmod 600 it.")
        return _checked(secret, f"${KEY_FILE_ENV} ({path})", who)
    if insecure or os.environ.get(INSECURE_ENV, "").lower() in ("1", "true", "yes"):
        log.warning("%s: the KV side channel runs in the insecure local mode: its messages "
                    "are not authenticated, and any process that reaches its port can ask "
                    "for the KV. Set %s or %s to a shared key outside a test.", who, KEY_ENV,
                    KEY_FILE_ENV)
        return SideChannelKey(None, "insecure local mode")
    raise DCPAuthError(f"{who}: the KV side channel needs a key shared by the prefill and "
                       f"decode engines, and none is set. Set {KEY_ENV} (at least "
                       f"{MIN_KEY_BYTES} characters, e.g. `python -c 'import secrets; "
                       f"print(secrets.token_hex(32))'`) or {KEY_FILE_ENV} in both engines' "
                       f"environments, or pass insecure=True for a local test.")


def _checked(secret: bytes, origin: str, who: str) -> SideChannelKey:
    if len(secret) < MIN_KEY_BYTES:
        raise DCPAuthError(f"{who}: the side channel's key from {origin} has {len(secret)} "
                           f"bytes; at least {MIN_KEY_BYTES} are needed. Use "
                           f"secrets.token_hex(32).")
    return SideChannelKey(secret, origin)


def _mac(key: SideChannelKey, body: bytes) -> bytes:
    return hmac.new(key.secret, _DOMAIN + body, hashlib.sha256).digest()


def seal(key: SideChannelKey, kind: MessageKind, sender: str, payload: bytes, *,
         reply_to: str | None = None) -> tuple[bytes, str]:
    """The sealed message (its canonical bytes, a newline, the hex MAC) and its nonce."""
    nonce = secrets.token_hex(16)
    body = json.dumps({"v": _SEAL_VERSION, "kind": str(kind), "sender": sender, "nonce": nonce,
                       "time": time.time(), "payload": base64.b64encode(payload).decode(),
                       "reply_to": reply_to}, sort_keys=True, separators=(",", ":")).encode()
    mac = b"" if key.insecure else _mac(key, body).hex().encode()
    return body + b"\n" + mac, nonce


@dataclass(frozen=True)
class Opened:
    """A message that passed: who sent it, its nonce and payload."""

    sender: str
    nonce: str
    payload: bytes


class Opener:
    """Checks sealed messages for one receiver and remembers the nonces it accepted (for
    ``max_age`` seconds, the time after which a message is refused as stale anyway)."""

    def __init__(self, key: SideChannelKey, *, max_age: float = MAX_AGE):
        self.key, self.max_age = key, max_age
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def open(self, raw: bytes, kind: MessageKind, *, reply_to: str | None = None,
             sender: str | None = None) -> Opened:
        """The message ``raw`` if it is a sealed ``kind`` that verifies, is fresh, answers
        ``reply_to`` (when given) and came from ``sender`` (when the transport names one);
        its nonce is remembered only then, so a captured copy sent first by another peer
        cannot burn the honest one."""
        body, sep, mac = bytes(raw).rpartition(b"\n")
        if not sep:
            raise DCPAuthError(f"a {kind} message without a seal (no MAC line): an unsigned "
                               f"or foreign client")
        if not self.key.insecure:
            try:
                given = bytes.fromhex(mac.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                given = b""
            if not hmac.compare_digest(given, _mac(self.key, body)):
                raise DCPAuthError(f"a {kind} message whose MAC does not verify: signed "
                                   f"with another key, with none, or changed on the way")
        try:
            d = json.loads(body)
            if type(d) is not dict or sorted(d) != sorted(ENVELOPE) or not all(
                    isinstance(d[k], t) and type(d[k]) is not bool for k, t in ENVELOPE.items()):
                raise ValueError("not a sealed message's fields")
            payload = base64.b64decode(d["payload"], validate=True)
        except (ValueError, RecursionError) as e:
            raise DCPAuthError(f"a {kind} message that is not readable ({e})") from None
        if d["kind"] != kind:
            raise DCPAuthError(f"a {d['kind']!r} message where a {kind} was expected (a "
                               f"message replayed as another kind)")
        now = time.time()
        age = now - d["time"]
        if age > self.max_age or age < -FUTURE_SKEW:
            raise DCPAuthError(f"a {kind} message from {d['sender']!r} sealed {age:.1f} s ago "
                               f"(accepted: up to {self.max_age:.0f} s old): stale or replayed")
        if reply_to is not None and d["reply_to"] != reply_to:
            raise DCPAuthError(f"a {kind} message from {d['sender']!r} that answers another "
                               f"request (a replayed answer)")
        if sender is not None and d["sender"] != sender:
            raise DCPAuthError(f"a {kind} message sealed by {d['sender']!r}, sent by agent "
                               f"{sender!r}")
        self._forget(now)
        if d["nonce"] in self._seen:
            raise DCPAuthError(f"a {kind} message from {d['sender']!r} whose nonce was seen "
                               f"before: a replay")
        self._seen[d["nonce"]] = now
        return Opened(d["sender"], d["nonce"], payload)

    def _forget(self, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) < now - self.max_age - FUTURE_SKEW:
            self._seen.popitem(last=False)

"""Who is calling, and what may it touch: identities, token scopes, the token check.

The model (docs/security.md):

- A call's **identity** is the name of the token it presented (``authorization: Bearer
  <secret>``, looked up in the daemon's tokens), or, on a Unix socket without a token,
  :data:`LOCAL_IDENTITY` (trusted by the socket file's mode; ``--unix-auth token`` makes Unix
  callers present a token too). gRPC Python does not expose a Unix caller's peer credentials
  (``context.peer()`` is ``"unix:"`` and the auth context says only ``insecure``), so there is
  no per-user identity on the socket. A TCP listener served without any token (loopback, or
  ``--allow-insecure-tcp``) calls its callers :data:`INSECURE_TCP_IDENTITY`.
- A **scope** is what an identity may use: ``admin`` (every pool, every lease in Stats), a
  list of pool-name patterns (``llama``, ``llama-tp*``), or ``peer``: another daemon, which may
  call only the daemon-to-daemon methods (PeerReceive, PeerDone) and no pool. Those two methods
  answer only admin and peer callers, never a tenant. The local identity and the single
  ``--token`` are admin.
- Leases belong to the identity that opened them and are proven by their secret
  (``kvpoold.server.leases.LeaseTable.prove``); Stats shows a non-admin caller only its own.

:class:`Authority` maps the call's metadata to a :class:`Caller` (the servicer asks it on every
call); :class:`kvpoold.server.auth.TokenAuthInterceptor` asks it too, before the request
message is read, so an unauthenticated call is refused early. Nothing here imports gRPC: the
settings check tokens with it before any server is built.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvpool.contract.errors import InvalidArgument, PermissionDenied, Unauthenticated, echo

AUTH_METADATA_KEY = "authorization"
BEARER = "Bearer "
LOCAL_IDENTITY = "local"
INSECURE_TCP_IDENTITY = "tcp"
# The one admin token of --token / --token-file is this identity.
SINGLE_TOKEN_IDENTITY = "admin"
Transport = Literal["unix", "tcp"]
UnixAuth = Literal["trust", "token"]
TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
POOL_PATTERN = re.compile(r"[a-z0-9*?][a-z0-9._*?-]{0,62}")


@dataclass(frozen=True)
class Scope:
    """What an identity may use: every pool (``admin``), or the pools matching ``pools``
    (``fnmatch`` patterns of ``*`` and ``?`` over pool names)."""

    admin: bool = False
    pools: tuple[str, ...] = ()
    peer: bool = False  # a peer daemon: PeerReceive and PeerDone only

    def covers(self, pool: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(pool, p) for p in self.pools)

    def describe(self) -> str:
        if self.admin:
            return "admin"
        if self.peer:
            return "the daemon-to-daemon methods only (a peer token)"
        return "pools " + (", ".join(self.pools) if self.pools else "(none)")


ADMIN = Scope(admin=True)


@dataclass(frozen=True)
class Caller:
    """The identity of one call and its scope."""

    identity: str
    scope: Scope

    @property
    def admin(self) -> bool:
        return self.scope.admin

    def check_peer(self, method: str) -> None:
        """Raise unless the caller is a peer daemon (an admin or peer token, or the local
        identity): tenants never reach the daemon-to-daemon methods.

        Raises:
            PermissionDenied: a tenant (a pool-scoped token).
        """
        if not (self.scope.admin or self.scope.peer):
            raise PermissionDenied(
                f"identity {self.identity!r} may use {self.scope.describe()}; {method} answers "
                "only peer daemons (an admin token, or a token with peer = true in "
                "--tokens-file)", field="authorization")

    def sees(self, pool: str) -> bool:
        """Whether the scope covers ``pool`` (Stats lists only those)."""
        return self.scope.covers(pool)

    def check_pool(self, pool: str, field: str = "pool") -> str:
        """``pool``, if the scope covers it; checked before the pool is looked up, so a refusal
        says nothing about whether it exists.

        Raises:
            PermissionDenied: it does not, naming the identity's pools.
        """
        if not self.scope.covers(pool):
            raise PermissionDenied(
                f"identity {self.identity!r} may use {self.scope.describe()}; pool "
                f"{echo(pool, 64)} is not among them (the token's pools in --tokens-file)",
                field=field)
        return pool


# The daemon's own view (metrics, shutdown): admin.
DAEMON_CALLER = Caller("kvpoold", ADMIN)
LOCAL_ADMIN = Caller(LOCAL_IDENTITY, ADMIN)


@dataclass(frozen=True)
class NamedToken:
    """One token of the daemon: its identity name, the secret (never shown), its scope."""

    name: str
    secret: str = field(repr=False)
    scope: Scope = ADMIN


def all_tokens(token: str | None, tokens: Sequence[NamedToken]) -> list[NamedToken]:
    """The single ``--token`` (admin, named :data:`SINGLE_TOKEN_IDENTITY`) and the named
    tokens, as one list."""
    single = [NamedToken(SINGLE_TOKEN_IDENTITY, token)] if token else []
    return [*single, *tokens]


def check_token_name(name: str) -> str:
    """A token's name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,62}``, not a reserved identity.

    Raises:
        InvalidArgument: anything else.
    """
    if not TOKEN_NAME.fullmatch(name):
        raise InvalidArgument(f"token name {echo(name, 64)} must match "
                              "[A-Za-z0-9][A-Za-z0-9._-]{0,62}", field="tokens_file")
    if name in (LOCAL_IDENTITY, INSECURE_TCP_IDENTITY, DAEMON_CALLER.identity):
        raise InvalidArgument(f"token name {name!r} is reserved for callers without a token; "
                              "choose another", field="tokens_file")
    return name


def check_pool_patterns(patterns: Iterable[str], where: str) -> tuple[str, ...]:
    """Pool-name patterns of a scope: pool names, with ``*`` and ``?`` allowed.

    Raises:
        InvalidArgument: a pattern no pool name could match.
    """
    out = []
    for p in patterns:
        if not POOL_PATTERN.fullmatch(p):
            raise InvalidArgument(f"{where}: pool pattern {echo(p, 64)} must be a pool name "
                                  "([a-z0-9][a-z0-9._-]{0,62}) with * and ? allowed",
                                  field="tokens_file")
        out.append(p)
    return tuple(out)


class Authority:
    """The daemon's tokens, and who a call is.

    Tokens are looked up by the SHA-256 of the secret presented, so the time a lookup takes
    does not depend on how much of a secret someone guessed right.

    Args:
        tokens: every token the daemon accepts (names and secrets unique).
        unix_auth: ``trust``: a Unix-socket caller without a token is :data:`LOCAL_ADMIN`;
            ``token``: it must present one too.
    """

    def __init__(self, tokens: Sequence[NamedToken] = (), unix_auth: UnixAuth = "trust") -> None:
        self._by_digest: dict[bytes, Caller] = {}
        for t in tokens:
            digest = _digest(t.secret)
            if digest in self._by_digest:
                raise InvalidArgument(f"tokens {self._by_digest[digest].identity!r} and "
                                      f"{t.name!r} have the same secret; give each its own",
                                      field="tokens_file")
            self._by_digest[digest] = Caller(t.name, t.scope)
        if len({c.identity for c in self._by_digest.values()}) != len(self._by_digest):
            raise InvalidArgument("two tokens have the same name", field="tokens_file")
        self.unix_auth = unix_auth

    @property
    def has_tokens(self) -> bool:
        return bool(self._by_digest)

    def needs_check(self, transport: Transport) -> bool:
        """Whether a call on ``transport`` can be refused for its token (then the server gets
        the interceptor)."""
        return self.has_tokens or (transport == "unix" and self.unix_auth == "token")

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None,
                 transport: Transport) -> Caller:
        """The caller of a call with ``metadata`` on ``transport``.

        Raises:
            Unauthenticated: a token that is not one of the daemon's, a malformed
                ``authorization``, or no token where one is needed.
        """
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                text = value.decode(errors="replace") if isinstance(value, bytes) else value
                if not text.startswith(BEARER):
                    raise Unauthenticated("metadata 'authorization' must be 'Bearer <token>'")
                caller = self._by_digest.get(_digest(text[len(BEARER):]))
                if caller is None:
                    raise Unauthenticated("the bearer token is wrong (not one of the daemon's "
                                          "--token-file / --tokens-file tokens)")
                return caller
        if transport == "unix" and self.unix_auth == "trust":
            return LOCAL_ADMIN
        if transport == "tcp" and not self.has_tokens:
            return Caller(INSECURE_TCP_IDENTITY, ADMIN)  # served so on purpose (a warning)
        where = ("TCP listeners need one of the daemon's tokens" if transport == "tcp" else
                 "this daemon serves Unix sockets with --unix-auth token")
        raise Unauthenticated(f"missing metadata 'authorization: Bearer <token>' ({where})")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()

"""Signed push notifications: the webhook verifies a JWT against the agent's JWKS.

The JWKS is served over loopback by a small HTTP server (fetched through the outbound
client and its guard); the test plays the agent and signs with keys it made. The
end-to-end case with the demo agent signing is in ``test_push_live.py``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from django.test import Client

from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tests.serving import serve_in_thread, stop_serving

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("empty_push_queue")]
ISSUER = "http://agent.test"


class Keys:
    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.kid = uuid.uuid4().hex[:12]

    def jwks(self) -> dict:
        public = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "use": "sig", "alg": "ES256"}]}


@pytest.fixture(autouse=True)
def no_remembered_key_sets() -> Iterator[None]:
    """Each test starts with no key set, and no failure to read one, remembered by URL.

    The caches live for the process, and a test's JWKS server may get the port an earlier
    test's server had: that test's failure, remembered for its URL, would answer for this
    one's first fetch.
    """
    push._jwks_cache.clear()
    push._jwks_failed.clear()
    yield
    push._jwks_cache.clear()
    push._jwks_failed.clear()


@pytest.fixture
def keys() -> Keys:
    return Keys()


@pytest.fixture
def jwks_url(keys: Keys) -> Iterator[str]:
    server, _ = _jwks_server(_answer(json.dumps(keys.jwks()).encode()))
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/jwks.json"
    finally:
        stop_serving(server)


@pytest.fixture
def config(jwks_url: str) -> PushConfig:
    agent = Agent.objects.create(
        name="signer", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    return push.new_config(task, jwks_url=jwks_url, jwt_issuer=ISSUER)


def body_of(ts: str = "2026-01-01T00:00:01Z") -> bytes:
    return json.dumps(
        {
            "statusUpdate": {
                "taskId": "t-1",
                "contextId": "c",
                "status": {"state": "TASK_STATE_WORKING", "timestamp": ts},
            }
        }
    ).encode()


def sign(keys: Keys, config: PushConfig, body: bytes, **overrides: object) -> str:
    now = int(time.time())
    claims = {
        "iss": ISSUER,
        "aud": config.config_id,
        "iat": now,
        "exp": now + 60,
        "jti": uuid.uuid4().hex,
        "request_body_sha256": hashlib.sha256(body).hexdigest(),
    }
    # A time given as a timedelta is that long after signing: computed when the test runs,
    # not when the module is collected (a long suite made a "future" iat a past one).
    claims.update(
        {
            k: now + int(v.total_seconds()) if isinstance(v, timedelta) else v
            for k, v in overrides.items()
        }
    )
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, keys.key, algorithm="ES256", headers={"kid": keys.kid})


def deliver(
    config: PushConfig, body: bytes, signed: str | None, *, token: str | None = None
) -> int:
    values = push.decrypt_json(config.secrets_encrypted)
    headers = {
        "REMOTE_ADDR": f"10.1.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}",
        "HTTP_X_A2A_NOTIFICATION_TOKEN": values["token"] if token is None else token,
    }
    if signed is not None:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {signed}"
    response = Client().post(
        f"/push/{config.config_id}/", data=body, content_type="application/json", **headers
    )
    return response.status_code


def nothing_recorded(config: PushConfig) -> bool:
    return (
        push._redis().llen(push.QUEUE_KEY) == 0
        and not TaskEvent.objects.filter(task_id=config.task_id).exists()
    )


def test_a_config_for_a_signing_agent_gives_it_no_authorization_credentials(config):
    wire = push.wire_config(config)
    assert "authentication" not in wire and wire["token"]


def test_a_good_signature_is_accepted_and_recorded(keys, config):
    body = body_of()
    assert deliver(config, body, sign(keys, config, body)) == 202
    push.record_batch(push._redis().lpop(push.QUEUE_KEY, 10))
    assert TaskEvent.objects.get(task_id=config.task_id).channel == "push"


def test_a_signature_by_another_key_is_refused(keys, config):
    body = body_of()
    impostor = Keys()
    impostor.kid = keys.kid  # claims to be the agent's key
    assert deliver(config, body, sign(impostor, config, body)) == 401
    assert nothing_recorded(config)


def test_an_unknown_key_id_is_refused(config):
    body = body_of()
    assert deliver(config, body, sign(Keys(), config, body)) == 401
    assert nothing_recorded(config)


def test_an_expired_token_is_refused(keys, config):
    body = body_of()
    old = int(time.time()) - 600
    assert deliver(config, body, sign(keys, config, body, iat=old, exp=old + 60)) == 401
    assert nothing_recorded(config)


def test_a_replayed_token_is_refused(keys, config):
    body = body_of()
    signed = sign(keys, config, body)
    assert deliver(config, body, signed) == 202
    push._redis().delete(push.QUEUE_KEY)
    assert deliver(config, body, signed) == 401  # same jti: refused before the repeat check
    other = body_of("2026-01-01T00:00:02Z")
    jti = jwt.decode(signed, options={"verify_signature": False})["jti"]
    assert deliver(config, other, sign(keys, config, other, jti=jti)) == 401
    assert push._redis().llen(push.QUEUE_KEY) == 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"aud": "someone-else"},
        {"iss": "http://impostor.test"},
        {"request_body_sha256": hashlib.sha256(b"other").hexdigest()},
        {"request_body_sha256": None},
        {"jti": None},
        {"exp": timedelta(seconds=3600)},  # lives longer than PUSH_JWT_MAX_LIFETIME_SECONDS
        {"iat": timedelta(seconds=600), "exp": timedelta(seconds=660)},  # issued in the future
    ],
    ids=["audience", "issuer", "body hash", "no body hash", "no jti", "too long", "future"],
)
def test_tokens_with_wrong_claims_are_refused(keys, config, overrides):
    body = body_of()
    assert deliver(config, body, sign(keys, config, body, **overrides)) == 401
    assert nothing_recorded(config)


def test_unsigned_and_unsafe_algorithms_are_refused(keys, config):
    body = body_of()
    assert deliver(config, body, None) == 401
    unsigned = jwt.encode({"iss": ISSUER, "aud": config.config_id}, key=None, algorithm="none")
    assert deliver(config, body, unsigned) == 401
    hmac_signed = jwt.encode(
        {"iss": ISSUER, "aud": config.config_id}, "guess" * 8, algorithm="HS256"
    )
    assert deliver(config, body, hmac_signed) == 401
    assert deliver(config, body, sign(keys, config, body), token="wrong") == 401
    assert nothing_recorded(config)


def _b64(value: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def test_a_header_naming_an_algorithm_of_another_key_type_is_a_refusal(keys, config, caplog):
    """An RS256 header over the agent's EC key made PyJWT raise TypeError: a 500 (503 and a
    traceback on the ASGI route) for anyone with the config's token, never counted."""
    body = body_of()
    for alg in ("RS256", "PS256", "EdDSA", "ES384"):
        forged = f"{_b64({'alg': alg, 'kid': keys.kid})}.e30.AAAA"
        assert deliver(config, body, forged) == 401, alg
    assert nothing_recorded(config)
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    "times",
    [{"exp": 10**400}, {"iat": -(10**400)}, {"iat": 1.5e300, "exp": 1.5e300 + 1}],
    ids=["exp past a float", "iat past a float", "times past exact floats"],
)
def test_a_signed_time_no_float_holds_is_a_refusal(keys, config, times):
    """A signed exp of 10**400 passed PyJWT (int() takes it), then float() raised: a 500."""
    body = body_of()
    assert deliver(config, body, sign(keys, config, body, **times)) == 401
    assert nothing_recorded(config)


def test_a_token_turned_away_for_the_config_rate_may_be_sent_again(
    keys, config, settings, monkeypatch
):
    """The jti was taken before the rate check: the retry of a 429 was refused as a replay
    (401, counted against the agent's address). It is taken with the delivery now."""
    settings.PUSH_RATE_PER_CONFIG = 1
    # The rate windows are whole seconds of the clock: held still here, so that a slow
    # machine's deliveries do not straddle two windows, then moved on by one.
    second_now = [int(time.time())]
    monkeypatch.setattr(push, "_window", lambda key, seconds: f"{key}:{second_now[0] // seconds}")
    first, second = body_of(), body_of("2026-01-01T00:00:02Z")
    assert deliver(config, first, sign(keys, config, first)) == 202
    signed = sign(keys, config, second)
    assert deliver(config, second, signed) == 429
    second_now[0] += 1  # the next window of the per-config rate
    assert deliver(config, second, signed) == 202
    assert deliver(config, second, signed) == 401  # and then it is a replay


# The agent's key set is the agent's: bounded like any call to it ---------------------------


def _jwks_server(respond) -> tuple[ThreadingHTTPServer, list[float]]:
    """A JWKS server answering with ``respond(handler)``; the times it was asked."""
    asked: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(time.monotonic())
            respond(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    serve_in_thread(server)
    return server, asked


def _answer(body: bytes):
    def respond(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return respond


def _trickler(seen: dict[str, int]):
    """Headers, then a byte every half second: each read is quick, the whole would take a
    minute. ``seen["hung_up"]`` counts the bytes sent before the dashboard hung up."""

    def respond(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "60000")
        handler.end_headers()
        for sent in range(120):
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                seen["hung_up"] = sent
                return
            time.sleep(0.5)

    return respond


def _config_at(url: str) -> PushConfig:
    agent = Agent.objects.create(
        name="signer", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    return push.new_config(task, jwks_url=url, jwt_issuer=ISSUER)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[1, 2]", "ValueError"),
        (b'{"keys": 5}', None),  # whatever the JWT library raises for it
        (b"[" * 5000 + b"]" * 5000, "ProtocolError"),  # deeper than any JSON we read
        (b"not json", "ProtocolError"),
    ],
    ids=["a list", "keys not a list", "too deep", "not JSON"],
)
def test_a_key_set_of_the_wrong_shape_is_a_refusal_not_an_error(keys, body, why, caplog):
    server, asked = _jwks_server(_answer(body))
    try:
        config = _config_at(f"http://127.0.0.1:{server.server_address[1]}/jwks.json")
        signed_body = body_of()
        with caplog.at_level("WARNING", logger="tasks_app.security"):
            assert deliver(config, signed_body, sign(keys, config, signed_body)) == 401
        reasons = [r.getMessage() for r in caplog.records if r.name == "tasks_app.security"]
        assert len(reasons) == 1 and "the agent's JWKS could not be read (" in reasons[0]
        if why:
            assert f"could not be read ({why})" in reasons[0]
        assert nothing_recorded(config)
        assert len(asked) == 1
    finally:
        stop_serving(server)


@pytest.mark.slow  # waits for the fetch's deadline by design
def test_a_trickling_key_set_is_cut_off_and_not_asked_again_at_once(keys, monkeypatch):
    monkeypatch.setattr(push, "JWKS_DEADLINE_SECONDS", 1.5)
    seen: dict[str, int] = {}
    server, asked = _jwks_server(_trickler(seen))
    try:
        config = _config_at(f"http://127.0.0.1:{server.server_address[1]}/jwks.json")
        body = body_of()
        assert deliver(config, body, sign(keys, config, body)) == 401
        # Each byte came within any per-read timeout; the whole fetch's deadline ended it:
        # the dashboard hung up a few bytes in, not after the 120 the server had.
        for _ in range(100):
            if "hung_up" in seen:
                break
            time.sleep(0.1)
        assert 0 < seen["hung_up"] < 20, seen
        # The next signed delivery is refused from what was learned, without a second fetch.
        assert deliver(config, body, sign(keys, config, body)) == 401
        assert len(asked) == 1
        assert nothing_recorded(config)
    finally:
        stop_serving(server)


def test_a_key_set_that_recovers_is_read_again_after_the_failure_pause(keys, monkeypatch):
    monkeypatch.setattr(push, "JWKS_FAILURE_SECONDS", 0.5)
    good = json.dumps(keys.jwks()).encode()
    bodies = [b"[]", good]
    server, asked = _jwks_server(lambda handler: _answer(bodies[min(len(asked) - 1, 1)])(handler))
    try:
        config = _config_at(f"http://127.0.0.1:{server.server_address[1]}/jwks.json")
        first, second = body_of("2026-01-01T00:00:01Z"), body_of("2026-01-01T00:00:02Z")
        assert deliver(config, first, sign(keys, config, first)) == 401
        time.sleep(0.6)  # the pause after a failure is over
        assert deliver(config, second, sign(keys, config, second)) == 202
        assert len(asked) == 2
    finally:
        stop_serving(server)


# An agent's key set as an attack on the webhook ---------------------------------------------


def _rsa_jwk_with(**members: str) -> dict:
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    return {**public, "kid": "rsa", **members}


def _b64_int(number: int) -> str:
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_private_or_oversized_keys_are_left_out_before_any_key_is_built(keys: Keys) -> None:
    """A made-up private exponent made PyJWT recover the primes (pow() with the agent's
    numbers: seconds to minutes holding the interpreter, the whole webhook stalled); a
    private key made verification raise AttributeError (500/503 with a traceback)."""
    good = keys.jwks()["keys"][0]
    hostile = [
        _rsa_jwk_with(d=_b64_int((1 << 12000) - 1)),  # "private", no primes
        _rsa_jwk_with(n=_b64_int((1 << 16384) - 1)),  # a modulus beyond 8,192 bits
        _rsa_jwk_with(e=_b64_int((1 << 3000) - 1)),  # an exponent beyond 32 bits
        {"kty": "oct", "k": "c2VjcmV0"},  # a shared secret
        "not a key",
    ]
    started = time.monotonic()
    assert push._public_keys([*hostile, good]) == [good]
    assert time.monotonic() - started < 0.5
    assert len(push._public_keys([good] * 100)) == push.JWKS_MAX_KEYS
    with pytest.raises(ValueError, match="no usable public key"):
        push._public_keys(hostile)


def test_a_token_a_private_key_in_the_set_would_verify_is_a_refusal(
    keys: Keys, config: PushConfig, monkeypatch
) -> None:
    """Whatever PyJWT raises for the agent's token and keys is a counted 401, not a 500."""

    def broken_decode(*args: object, **kwargs: object) -> dict:
        raise AttributeError("'RSAPrivateKey' object has no attribute 'verify'")

    monkeypatch.setattr(push.jwt, "decode", broken_decode)
    body = body_of()
    assert deliver(config, body, sign(keys, config, body)) == 401


def test_concurrent_deliveries_fetch_the_key_set_once(keys: Keys, config: PushConfig) -> None:
    """Each delivery that found no key set cached fetched its own: a slow JWKS held every
    one of the webhook's blocking threads for its whole deadline."""
    from tests.races import release_together

    def slow(handler: BaseHTTPRequestHandler) -> None:
        time.sleep(0.5)
        _answer(json.dumps(keys.jwks()).encode())(handler)

    server, asked = _jwks_server(slow)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/jwks.json"
        found = release_together(*(lambda: push._keyset(url) for _ in range(4)))
    finally:
        stop_serving(server)
    assert all(isinstance(k, jwt.PyJWKSet) for k in found), found
    assert len(asked) == 1

"""Access control: key parsing, the policy's decisions, and a real server with keys set."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from router.errors import ConfigError, Forbidden, Unauthorized
from router.http.auth import Access, AccessPolicy, read_keys
from tests.conftest import serve

PREDICT = "p" * 20
ADMIN = "a" * 24


def policy(**kwargs: bool) -> AccessPolicy:
    return AccessPolicy(predict_keys=(PREDICT.encode(),), admin_keys=(ADMIN.encode(),), **kwargs)


def test_keys_from_value_and_file(tmp_path: Path) -> None:
    secret = tmp_path / "keys"
    secret.write_text(f"# rotated 2026-11\n{'k' * 16}\n\n  {'m' * 17}  \n", encoding="utf-8")
    assert read_keys(f"{'x' * 16}, {'y' * 16}", secret, "KEYS") == (b"x" * 16, b"y" * 16, b"k" * 16, b"m" * 17)
    assert read_keys(None, None, "KEYS") == ()


@pytest.mark.parametrize(("inline", "file", "words"), [
    ("short", None, "at least 16 characters"),
    (None, Path("/nonexistent/keys"), "KEYS_FILE: cannot read"),
    (" , ", None, "KEYS is set but holds no key"),
    ("", None, "KEYS is set but holds no key"),
    ("ключ-из-шестнадцати-знаков", None, "key 1 has a character that is not printable ASCII"),
    ("a-good-key-of-16-chars, tab\tinside-a-long-key", None, "key 2 has a character"),
])
def test_bad_keys_are_configuration_errors(inline: str | None, file: Path | None, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as error:
        read_keys(inline, file, "KEYS")
    assert "ключ" not in str(error.value) and "a-good-key" not in str(error.value)  # keys are never shown


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n", "   \n"])
def test_an_empty_key_file_refuses_to_start(tmp_path: Path, content: str) -> None:
    secret = tmp_path / "keys"
    secret.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match="holds no key"):
        read_keys(None, secret, "KEYS")


def test_protection_without_any_key_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match="MODEL_ROUTER_PROTECT_HEALTH is set but no API or admin key"):
        AccessPolicy(protect_health=True).check_consistent()
    policy().check_consistent()


def test_the_start_up_line_says_which_protection_is_on() -> None:
    assert AccessPolicy().describe().startswith("access: open (no API keys set)")
    admin_only = AccessPolicy(admin_keys=(ADMIN.encode(),)).describe()
    assert "inference needs the admin key" in admin_only and "health open" in admin_only
    both = policy(protect_health=True).describe()
    assert "1 inference key(s)" in both and "1 admin key(s)" in both and "health protected" in both
    assert PREDICT not in both and ADMIN not in both


def test_admin_keys_alone_make_inference_need_a_key() -> None:
    """Failing closed: with only admin keys set, inference is not open."""
    admin_only = AccessPolicy(admin_keys=(ADMIN.encode(),))
    with pytest.raises(Unauthorized):
        admin_only.check(Access.PREDICT, None)
    admin_only.check(Access.PREDICT, f"Bearer {ADMIN}")


def test_without_keys_everything_is_open() -> None:
    for access in Access:
        AccessPolicy().check(access, None)


@pytest.mark.parametrize("access", [Access.PREDICT, Access.ADMIN])
@pytest.mark.parametrize(
    "header", [None, "", "Bearer", f"Basic {PREDICT}", "Bearer wrong-key-of-some-length", f"bearer {PREDICT}x"]
)
def test_missing_or_wrong_keys_are_401(access: Access, header: str | None) -> None:
    with pytest.raises(Unauthorized) as error:
        policy().check(access, header)
    assert error.value.status_code == 401 and error.value.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("values", [(f"Bearer {PREDICT}", "Bearer wrong-key-of-some-length"),
                                    ("Bearer wrong-key-of-some-length", f"Bearer {PREDICT}"),
                                    (f"Bearer {PREDICT}", f"Bearer {PREDICT}")])
def test_two_authorization_values_are_401_whichever_is_right(values: tuple[str, str]) -> None:
    with pytest.raises(Unauthorized) as error:
        policy().check(Access.PREDICT, values)
    assert error.value.detail == "send one key ('Authorization: Bearer <key>'); the request carries 2 authorization values"
    assert not policy().holds_key(values)
    policy().check(Access.PREDICT, values[1:] if values[1].endswith(PREDICT) else values[:1])  # one value: the key
    AccessPolicy().check(Access.PREDICT, values)  # no keys set: nothing is read


def test_holding_a_key() -> None:
    assert policy().holds_key(f"Bearer {PREDICT}") and policy().holds_key((f"Bearer {ADMIN}",))
    assert not policy().holds_key(None) and not policy().holds_key("Bearer wrong-key-of-some-length")
    assert not AccessPolicy().holds_key(f"Bearer {PREDICT}")  # no keys set: nobody holds one


@pytest.mark.e2e
def test_two_authorization_values_are_refused_over_http_and_grpc(tmp_path: Path) -> None:
    """Wrong then right, and right then wrong: 401 over HTTP and UNAUTHENTICATED over gRPC alike (before: HTTP
    read the first value and gRPC the last, so wrong-then-right was 401 over HTTP and served over gRPC)."""
    import grpc
    from tritonclient.grpc import service_pb2

    detail = "send one key ('Authorization: Bearer <key>'); the request carries 2 authorization values"
    right, wrong = f"Bearer {PREDICT}", "Bearer wrong-key-of-some-length"
    with serve(tmp_path, "models:\n  m: {plugin: scripted}\n", env={"MODEL_ROUTER_API_KEYS": PREDICT}) as server, \
            grpc.insecure_channel(server.grpc_address) as channel:
        metadata = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata",
                                       request_serializer=service_pb2.ModelMetadataRequest.SerializeToString,
                                       response_deserializer=service_pb2.ModelMetadataResponse.FromString)
        for pair in ((wrong, right), (right, wrong)):
            answer = httpx.post(server.url + "/models/m/predict", json={"id": "a"},
                                headers=[("Authorization", pair[0]), ("Authorization", pair[1])])
            assert (answer.status_code, answer.json()["detail"]) == (401, detail)
            v2 = httpx.get(server.url + "/v2/models/m", headers=[("Authorization", pair[0]), ("Authorization", pair[1])])
            assert (v2.status_code, v2.json()["error"]) == (401, detail)
            with pytest.raises(grpc.RpcError) as refused:
                metadata(service_pb2.ModelMetadataRequest(name="m"), metadata=(("authorization", pair[0]),
                                                                               ("authorization", pair[1])), timeout=10)
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, detail)
        served = httpx.post(server.url + "/models/m/predict", json={"id": "b"}, headers={"Authorization": right})
        assert served.status_code == 200
        assert metadata(service_pb2.ModelMetadataRequest(name="m"), metadata=(("authorization", right),),
                        timeout=10).name == "m"


def test_inference_key_cannot_change_state() -> None:
    policy().check(Access.PREDICT, f"Bearer {PREDICT}")
    with pytest.raises(Forbidden) as error:
        policy().check(Access.ADMIN, f"Bearer {PREDICT}")
    assert error.value.status_code == 403


def test_admin_key_grants_everything() -> None:
    for access in Access:
        policy(protect_health=True, protect_metrics=True).check(access, f"bearer  {ADMIN}")


def test_health_and_metrics_are_open_unless_protected() -> None:
    policy().check(Access.HEALTH, None)
    policy().check(Access.METRICS, None)
    with pytest.raises(Unauthorized):
        policy(protect_health=True).check(Access.HEALTH, None)
    with pytest.raises(Unauthorized):
        policy(protect_metrics=True).check(Access.METRICS, None)


@pytest.mark.e2e
def test_a_server_with_keys(tmp_path: Path) -> None:
    keys = tmp_path / "admin-keys"
    keys.write_text(ADMIN + "\n", encoding="utf-8")
    env = {"MODEL_ROUTER_API_KEYS": PREDICT, "MODEL_ROUTER_ADMIN_KEYS_FILE": str(keys),
           "MODEL_ROUTER_PROTECT_METRICS": "true"}
    with serve(tmp_path, "models:\n  m: {plugin: scripted}\n", env=env) as server:
        url = server.url + "/models/m/predict"
        anonymous = httpx.post(url, json={"id": "a"})
        wrong = httpx.post(url, json={"id": "b"}, headers={"Authorization": "Bearer not-the-right-key!"})
        right = httpx.post(url, json={"id": "c"}, headers={"Authorization": f"Bearer {PREDICT}"})
        admin = httpx.post(url, json={"id": "d"}, headers={"Authorization": f"Bearer {ADMIN}"})
        health = httpx.get(server.url + "/health/ready")
        metrics = httpx.get(server.url + "/metrics")
        metrics_with_key = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {PREDICT}"})
        listing = httpx.get(server.url + "/models")
        log = server.log()
    assert anonymous.status_code == wrong.status_code == 401
    assert "access: keys required; inference and model listing need 1 inference key(s)" in log
    assert "Bearer" in anonymous.headers["www-authenticate"] and "API key" in anonymous.json()["detail"]
    assert right.status_code == admin.status_code == 200
    assert health.status_code == 200
    assert metrics.status_code == 401 and metrics_with_key.status_code == 200
    assert listing.status_code == 401
    assert PREDICT not in log and ADMIN not in log  # keys never reach the logs


def test_keys_in_the_fleet_file_are_refused(tmp_path: Path) -> None:
    from router.config import load_fleet

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"api_keys: [{PREDICT}]\nmodels:\n  m: {{plugin: scripted}}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="API keys never go in the fleet file; set MODEL_ROUTER_API_KEYS"):
        load_fleet(fleet)

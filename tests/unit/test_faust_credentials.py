"""The faust worker's client takes a production cluster's TLS/SASL from the same
`TOLLGATE_KAFKA_<SETTING>` variables (librdkafka names) as the confluent clients, and refuses by
name a security setting it cannot take."""

from __future__ import annotations

import certifi
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from tollgate_llm.api.config import load_settings
from tollgate_llm.streams.faust_worker import faust_credentials
from tollgate_llm.streams.topics import KafkaSettingError, client_settings


def _auth(settings: dict[str, str]) -> dict[str, object]:
    return dict(credentials_to_aiokafka_auth(faust_credentials(settings)))


def test_a_plaintext_cluster_needs_no_credentials_and_tuning_settings_are_left_alone() -> None:
    assert faust_credentials({"bootstrap.servers": "k:9092", "linger.ms": "5"}) is None
    assert _auth({"security.protocol": "plaintext"})["security_protocol"] == "PLAINTEXT"


def test_sasl_ssl_from_the_environment_reaches_the_client(monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("TOLLGATE_KAFKA_SASL_MECHANISM", "scram-sha-512")
    monkeypatch.setenv("TOLLGATE_KAFKA_SASL_USERNAME", "tollgate")
    monkeypatch.setenv("TOLLGATE_KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("TOLLGATE_KAFKA_SSL_CA_LOCATION", certifi.where())
    # Read once, by the settings object, and passed down (api/config.py).
    kafka_settings = load_settings().kafka_client_settings()
    auth = _auth(client_settings("k:9093", kafka_settings=kafka_settings))
    assert auth["security_protocol"] == "SASL_SSL"
    assert auth["sasl_mechanism"] == "SCRAM-SHA-512"
    assert auth["sasl_plain_username"] == "tollgate"
    assert auth["sasl_plain_password"] == "s3cret"
    assert auth["ssl_context"] is not None


def test_tls_alone() -> None:
    auth = _auth({"security.protocol": "SSL", "ssl.ca.location": certifi.where()})
    assert auth["security_protocol"] == "SSL" and auth["ssl_context"] is not None


def test_sasl_without_tls_defaults_to_plain() -> None:
    auth = _auth({"security.protocol": "SASL_PLAINTEXT", "sasl.username": "u",
                  "sasl.password": "p"})
    assert auth["security_protocol"] == "SASL_PLAINTEXT"
    assert auth["sasl_mechanism"] == "PLAIN"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"ssl.endpoint.identification.algorithm": "none"}, "ssl.endpoint.identification"),
        ({"sasl.oauthbearer.method": "oidc"}, "sasl.oauthbearer.method"),
        ({"security.protocol": "sasl_ssl", "sasl.mechanism": "GSSAPI"}, "GSSAPI"),
        ({"security.protocol": "tls"}, "security.protocol"),
    ],
)
def test_a_security_setting_it_cannot_take_is_refused_by_name(
    settings: dict[str, str], named: str
) -> None:
    with pytest.raises(KafkaSettingError, match=named):
        faust_credentials(settings)

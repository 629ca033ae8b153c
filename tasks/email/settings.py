"""The email family's settings (``CONVEYOR_EMAIL``, JSON): the provider and its connection,
the sender, the retry schedule and what to do about a send whose outcome is unknown."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SETTING = "CONVEYOR_EMAIL"


class SmtpSettings(BaseModel):
    """An SMTP relay. ``starttls`` verifies the server's certificate against ``ca_file`` (or the
    system's store when unset); AUTH is only attempted when ``username`` is set."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=25, ge=1, le=65535)
    starttls: bool = False
    ca_file: Path | None = None
    username: str | None = None
    password: SecretStr | None = None
    timeout: float = Field(default=30, gt=0)


class HttpSettings(BaseModel):
    """An HTTP email API: ``POST {url}/emails`` with an ``Idempotency-Key``."""

    model_config = ConfigDict(extra="forbid")

    url: str
    token: SecretStr | None = None
    timeout: float = Field(default=30, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{SETTING} http.url must start with http:// or https://")
        return value.rstrip("/")


class SesSettings(BaseModel):
    """Amazon SES (v2). Credentials unset: boto3's own chain (environment, profile, role)."""

    model_config = ConfigDict(extra="forbid")

    region: str = "us-east-1"
    endpoint_url: str | None = None
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    configuration_set: str | None = None

    @model_validator(mode="after")
    def _both_keys(self) -> SesSettings:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(f"{SETTING} ses: set both access_key_id and secret_access_key, or neither")
        return self


class EmailSettings(BaseModel):
    """The whole ``CONVEYOR_EMAIL`` setting. The chosen ``provider`` needs its section
    (``smtp`` has defaults: a relay on 127.0.0.1:25)."""

    model_config = ConfigDict(extra="forbid")

    provider: Literal["smtp", "http", "ses"] = "smtp"
    from_address: str = "no-reply@localhost"
    smtp: SmtpSettings = SmtpSettings()
    http: HttpSettings | None = None
    ses: SesSettings | None = None
    retry_delays: list[float] = Field(default_factory=lambda: [1.0, 5.0, 30.0, 120.0, 600.0])
    max_attempts: int = Field(default=5, ge=1)
    on_unknown: Literal["hold", "resend"] = "hold"
    pii_key: SecretStr | None = Field(default=None, min_length=16)  # an HMAC key: 16+ characters
    message_id_domain: str | None = None
    # Accept special-use domains (``.test``, ``.local``) in addresses: for tests and the demo,
    # whose addresses can never reach a mailbox. Off: such an address is refused at submit.
    allow_test_domains: bool = False

    @field_validator("from_address")
    @classmethod
    def _plain_address(cls, value: str) -> str:
        # Not email-validator: the default's domain (localhost) has no dot, and this is ours,
        # not a producer's. Only what would break the envelope or a header is refused.
        local, at, domain = value.rpartition("@")
        if not at or not local or not domain or any(c in value for c in "\r\n <>"):
            raise ValueError(f"{SETTING} from_address must be a plain address (local@domain)")
        return value

    @field_validator("retry_delays")
    @classmethod
    def _delays(cls, value: list[float]) -> list[float]:
        if not value or any(d < 0 for d in value):
            raise ValueError(f"{SETTING} retry_delays must be a non-empty list of seconds >= 0")
        return value

    @field_validator("message_id_domain")
    @classmethod
    def _domain(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c in value for c in "\r\n <>@")):
            raise ValueError(f"{SETTING} message_id_domain must be a bare domain")
        return value

    @model_validator(mode="after")
    def _provider_section(self) -> EmailSettings:
        if self.provider == "http" and self.http is None:
            raise ValueError(f'{SETTING}: provider "http" needs an "http" section (at least "url")')
        if self.provider == "ses" and self.ses is None:
            raise ValueError(f'{SETTING}: provider "ses" needs a "ses" section (e.g. {{"region": "..."}})')
        return self

    @property
    def id_domain(self) -> str:
        """The domain of our Message-IDs: ``message_id_domain``, else the sender's domain."""
        return self.message_id_domain or self.from_address.rpartition("@")[2]

    def pii_key_bytes(self) -> bytes:
        """The HMAC key for CPF/CNPJ hashes; a :class:`ConfigurationError` naming the setting
        when it is unset (the family starts without it: only hashing is refused)."""
        from conveyor.errors import ConfigurationError

        if self.pii_key is None or not self.pii_key.get_secret_value():
            raise ConfigurationError(f"{SETTING} pii_key is not set: a CPF/CNPJ cannot be hashed without it")
        return self.pii_key.get_secret_value().encode()


def email_settings_of(settings: object, default: EmailSettings | None = None) -> EmailSettings:
    """``CONVEYOR_EMAIL`` of a platform's settings (a deployment without the family's
    settings: ``default``, else the defaults)."""
    found = getattr(settings, "email", None)
    return found if isinstance(found, EmailSettings) else default or EmailSettings()

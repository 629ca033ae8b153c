"""The SES provider: SES v2 ``SendEmail`` with the raw MIME message (our headers go through),
through a boto3 client that never resends on its own (``total_max_attempts`` 1): a resend
is the stage's decision, taken knowing the outcome may be unknown. SES replaces the
Message-ID, so its ``MessageId`` is the provider id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.email.errors import DeliveryUncertain, EmailRejected, ProviderRefused, ProviderUnavailable
from tasks.email.providers import Delivery, OutgoingEmail, build_message
from tasks.email.settings import SesSettings

THROTTLING = frozenset(
    {"Throttling", "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded", "SlowDown"}
)


class SesProvider:
    """Sends through Amazon SES v2 (:class:`SesSettings`). ``client`` is the boto3 client (a
    test may wrap it in botocore's ``Stubber``)."""

    name = "ses"

    def __init__(self, settings: SesSettings) -> None:
        import boto3
        from botocore.config import Config

        self.settings = settings
        keys: dict[str, Any] = {}
        if settings.access_key_id is not None and settings.secret_access_key is not None:
            keys = {
                "aws_access_key_id": settings.access_key_id.get_secret_value(),
                "aws_secret_access_key": settings.secret_access_key.get_secret_value(),
            }
        self.client: Any = boto3.client(
            "sesv2",
            region_name=settings.region,
            endpoint_url=settings.endpoint_url,
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
            **keys,
        )

    def send(self, email: OutgoingEmail, *, before_commit_point: Callable[[], None]) -> Delivery:
        """Send ``email``; see :mod:`tasks.email.providers` for the contract."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionClosedError,
            EndpointConnectionError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        message = build_message(email)
        request: dict[str, Any] = {
            "FromEmailAddress": email.from_address,
            "Destination": {
                "ToAddresses": [email.to],
                "CcAddresses": list(email.cc),
                "BccAddresses": list(email.bcc),
            },
            "Content": {"Raw": {"Data": message.as_bytes(policy=message.policy)}},
        }
        if self.settings.configuration_set:
            request["ConfigurationSetName"] = self.settings.configuration_set
        before_commit_point()
        try:
            answer = self.client.send_email(**request)
        except ClientError as exc:
            raise _client_error(exc.response) from None
        except (ReadTimeoutError, ConnectionClosedError):
            raise DeliveryUncertain(
                "no response from SES after the request was sent; the message may have been accepted"
            ) from None
        except EndpointConnectionError as exc:  # ConnectTimeoutError too: nothing reached SES
            raise ProviderUnavailable(
                f"SES could not be reached ({type(exc).__name__}); nothing was sent"
            ) from None
        except (NoCredentialsError, PartialCredentialsError):
            raise ProviderRefused("no usable AWS credentials for SES (CONVEYOR_EMAIL ses)") from None
        except HTTPClientError as exc:
            raise DeliveryUncertain(
                f"the SES request failed ({type(exc).__name__}); it may have been accepted"
            ) from None
        except BotoCoreError as exc:  # raised before sending: parameter validation and the like
            raise ProviderRefused(f"the SES request could not be made ({type(exc).__name__})") from None
        return Delivery(self.name, str(answer["MessageId"]), ())


def _client_error(response: Any) -> Exception:
    """The family's error for an SES error answer (its text may quote addresses: not kept)."""
    error = response.get("Error", {}) if isinstance(response, dict) else {}
    code = str(error.get("Code", "Unknown"))
    status = (
        response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    )
    status = status if isinstance(status, int) else None
    if code in THROTTLING or status == 429:
        return ProviderUnavailable(f"SES is throttling ({code}); nothing was sent", code=status)
    if code == "MessageRejected":
        return EmailRejected(f"SES rejected the message ({code})", code=status)
    if status is not None and status >= 500:
        return ProviderUnavailable(f"SES failed ({code}, {status}); nothing was sent", code=status)
    return ProviderRefused(f"SES refused the request ({code})", code=status)

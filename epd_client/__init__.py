"""Python client for an epd front door (gRPC)."""

from epd_client.client import AskResult, AsyncEpdClient, EpdClient, EpdError

__all__ = ["AskResult", "AsyncEpdClient", "EpdClient", "EpdError"]

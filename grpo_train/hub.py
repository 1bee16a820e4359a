"""The Hugging Face hub on a machine that may have no network: a model or dataset id that would
be downloaded fails within seconds, with a way out, instead of hanging in retries."""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.parse

from .flags import UsageError


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' older TRANSFORMERS_OFFLINE) is set to a true value."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why a TCP connection to the hub (or to the HTTPS proxy in the environment) did not open
    within `timeout_s`; None when it did. Name lookup runs in a thread, so it is bounded too."""
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(k)), None)
    target = proxy or hub_endpoint()
    url = urllib.parse.urlparse(target if "://" in target else f"http://{target}")
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect():
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{url.hostname}:{port}: {err}")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s + 1.0)
    return outcome[0] if outcome else f"{url.hostname}:{port}: no answer in {timeout_s:.0f} s"


def check_hub_reachable(flag: str, name: str, local_hint: str) -> None:
    """UsageError, within seconds, when `name` would be downloaded but the hub cannot be
    reached (HF_HUB_OFFLINE=1: nothing to check, the libraries read their cache)."""
    if hub_offline():
        return
    reason = hub_unreachable()
    if reason is not None:
        raise UsageError(
            f"{flag} {name!r} is not a local path and the Hugging Face hub ({hub_endpoint()}) "
            f"cannot be reached ({reason}); pass {local_hint} instead (downloaded where there "
            "is network), or set HF_HUB_OFFLINE=1 to use what is in the local cache")


def cache_only(flag: str, repo_id: str, revision: str | None) -> bool:
    """Whether to load `repo_id` from the local cache only: yes when offline, or when the hub
    cannot be reached and the cache has it; an error when the hub is unreachable and the cache
    does not have it."""
    from huggingface_hub import try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    if hub_offline():
        if not cached:
            raise UsageError(
                f"{flag} {repo_id!r} is neither a local directory nor in the local Hugging Face "
                "cache, and HF_HUB_OFFLINE=1 forbids downloading it; pass a local model "
                "directory (downloaded where there is network)")
        return True
    try:
        check_hub_reachable(flag, repo_id, "a local model directory")
    except UsageError:
        if cached:
            print(f"{flag} {repo_id!r}: the hub cannot be reached; using the cached copy",
                  file=sys.stderr, flush=True)
            return True
        raise
    return False

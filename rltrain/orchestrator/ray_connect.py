"""Which Ray a run uses, found in seconds: a cluster it was told to join, the one ``ray start``
recorded on this machine, or a private instance of its own.

Contract:

- :func:`resolve_ray` (before the slow preparations) picks the target. An address in
  ``cluster.ray_address`` or ``RAY_ADDRESS`` is probed (a TCP connect, then Ray's GCS handshake with
  this process's authentication settings, each bounded by ``timeout_s``): one that does not answer
  or refuses us raises :class:`RayConnectionError`, one line naming the address, where it came from
  and how to run on a private instance instead. ``local`` (Ray's word for a new instance of this
  process) means a private instance. Otherwise the cluster that ``ray start`` recorded in Ray's temp
  directory is joined when its GCS answers (a stale record, left by a head stopped without
  ``ray stop``, is ignored with a warning), else a private instance is started.
- Ray instances that other processes started for themselves, another run's private Ray among them,
  are never joined: unlike ``ray.init(address="auto")`` there is no scan of the machine's processes
  for a running GCS (a second run used to join the first one's and fail 35 s later on its token).
- :func:`connect_ray` joins or starts the target; it returns whether it started Ray (and the caller
  should shut it down).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from rltrain.config import RLConfig
from rltrain.errors import RunStopped
from rltrain.logging.console import stage

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
"""Bound of each step of the probe of a cluster address (TCP connect, GCS handshake)."""


class RayConnectionError(RunStopped):
    """A Ray cluster the run was told to join does not answer or refuses it."""


@dataclass(frozen=True)
class RayTarget:
    address: str | None
    """The cluster to join; None starts a private local instance."""

    source: str
    """Where the address came from (``cluster.ray_address``, ``RAY_ADDRESS``, ``ray start``)."""


def resolve_ray(config: RLConfig, *, timeout_s: float = PROBE_TIMEOUT_S) -> RayTarget:
    """The Ray this run will use, each address probed (see the module docstring)."""
    source = "cluster.ray_address" if config.cluster.ray_address else "RAY_ADDRESS"
    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address == "local":
        return RayTarget(None, source)
    if address is not None and address != "auto":
        probe_cluster(address, source=source, timeout_s=timeout_s)
        return RayTarget(address, source)
    recorded = recorded_cluster(timeout_s=timeout_s)
    if recorded is not None:
        _use_local_token_like_ray_init()
        probe_cluster(recorded, source="recorded by `ray start` on this machine", timeout_s=timeout_s)
        return RayTarget(recorded, "ray start")
    if address == "auto":
        raise RayConnectionError(
            f"{source}=auto: no Ray cluster was started on this machine with `ray start`; for a private "
            f"Ray instance of this run set {_private_hint(source)}"
        )
    return RayTarget(None, "")


def connect_ray(config: RLConfig, target: RayTarget | None = None) -> bool:
    """Join or start Ray (``target``: :func:`resolve_ray`'s, resolved here if None); returns whether
    this process started it (and should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    target = target or resolve_ray(config)
    if target.address is not None:
        ray.init(address=target.address, log_to_driver=True)
        log.info("joined the running Ray cluster at %s (%s)", target.address, target.source)
        return False
    cpus = config.cluster.num_cpus
    with stage(f"starting a local Ray instance ({cpus or 'all'} CPUs)"):
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    return True


def probe_cluster(address: str, *, source: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`RayConnectionError` unless the GCS at ``address`` answers and accepts this
    process within ``timeout_s`` per step. Ray Client addresses (``ray://``) are left to Ray."""
    if address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        raise RayConnectionError(_refusal(address, source, f"nothing answers there ({err})")) from None
    import ray.exceptions
    from ray._raylet import InnerGcsClient

    try:
        InnerGcsClient.standalone(address, None, int(timeout_s * 1000))
    except ray.exceptions.AuthenticationError as err:
        why = str(err).split(". ")[0]
        raise RayConnectionError(
            _refusal(address, source, f"it refuses this process ({why}: give it the cluster's token)")
        ) from None
    except Exception as err:  # Ray's own error types for an unusable GCS: named in the message
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RayConnectionError(_refusal(address, source, f"its GCS does not answer ({why})")) from None


def recorded_cluster(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """The address ``ray start`` recorded on this machine if something listens there, else None.

    ``ray.init(address="auto")`` trusts ``<ray temp dir>/ray_current_cluster``; a head that was
    killed without ``ray stop`` leaves it behind, and ``ray.init`` then retries that address for
    many minutes. A plain TCP connect tells a live GCS from a stale file first.
    """
    from ray._private.utils import read_ray_address

    address = read_ray_address()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return address
    except (OSError, ValueError):
        log.warning(
            "ignoring the Ray cluster address %s found on this machine (nothing answers there: a head "
            "stopped without `ray stop`?); starting a local Ray instead",
            address,
        )
        return None


def _use_local_token_like_ray_init() -> None:
    """Turn token authentication on when this machine holds a Ray token, as ``ray.init`` does for
    a cluster it finds by itself (it does not for an address it is given, which we then pass)."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _private_hint(source: str) -> str:
    """How to ask for a private instance instead of the address that came from ``source``."""
    return "RAY_ADDRESS=local (or unset it)" if source == "RAY_ADDRESS" else "cluster.ray_address=local"


def _refusal(address: str, source: str, why: str) -> str:
    return (
        f"cannot join the Ray cluster at {address} ({source}): {why}; to run on a private Ray "
        f"instance of this run instead, set {_private_hint(source)}"
    )

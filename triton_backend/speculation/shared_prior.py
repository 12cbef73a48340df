"""A drafter's acceptance measured over the deployment's requests: the prior a new request starts from.

Under the gain rule a request starts from a prior acceptance and learns its own. A fixed prior
per drafter type (0.6 for a model drafter) is far off for a drafter that accepts 0.17 on the
deployment's traffic: every request then drafts at a loss until its own evidence says stop, and
probes again later at a loss. :class:`SharedAcceptance` keeps one slowly decaying acceptance
estimate per deployed drafter, fed by every round its requests draft; a new request starts
from it (a drafter that does not pay here is not tried at every request). So that a drafter
once judged poor is tried again when the traffic changes, the shared evidence fades by
``refresh`` each time a request starts from it: after some tens of requests without drafting,
the type's prior is back and one request probes.

Only requests whose output cannot depend on it use it: greedy requests and unseeded sampling
(a seeded sampling request's draft lengths, hence its random stream, must depend on the
request alone, so it starts from the type's prior).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from triton_backend.speculation.policy import AcceptanceEstimate, DrafterKind, Prior

POSITIONS = 16  # draft positions tracked (a request drafts at most its own max_k of them)


class SharedAcceptance:
    """One deployed drafter's acceptance over its requests (thread-safe: scheduler and loops)."""

    def __init__(self, prior: Prior, strength: float = 4.0, decay: float = 0.99, refresh: float = 0.9) -> None:
        self._estimate = AcceptanceEstimate(POSITIONS, prior, strength, decay)
        self._refresh = refresh
        self._lock = threading.Lock()

    def prior(self) -> Prior:
        """The prior for a new request (first position, later positions); fades the evidence by ``refresh``."""
        with self._lock:
            conditional = self._estimate.conditional()
            self._estimate.age(self._refresh)
        later = conditional[1:4]
        return conditional[0], sum(later) / len(later)

    def record(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self._estimate.record(drafted, accepted)


_SHARED: "weakref.WeakKeyDictionary[Any, dict[DrafterKind, SharedAcceptance]]" = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def shared_acceptance(drafter: Any, kind: DrafterKind, prior: Prior) -> SharedAcceptance | None:
    """The shared estimate of ``drafter`` (one per deployed drafter object and kind); None for a
    drafter that cannot be keyed (no weak references)."""
    with _REGISTRY_LOCK:
        try:
            per_kind = _SHARED.setdefault(drafter, {})
        except TypeError:
            return None
        return per_kind.setdefault(kind, SharedAcceptance(prior))


__all__ = ["SharedAcceptance", "shared_acceptance"]

"""OpenMP defaults for an engine server's model processes, set before torch loads.

torch runs its CPU ops (and our kernels' at::parallel_for) on libgomp, the OpenMP runtime it
ships. After every parallel region libgomp's threads spin-wait for the next one, up to
GOMP_SPINCOUNT iterations (default 300 000: a few hundred microseconds) before they sleep.
A decode or prefill step is hundreds of short parallel regions with Python in between, so
while an engine is busy its OpenMP workers spin the whole time. Alone on its cores that
only wastes what nobody else wants; but a P and a D started on one node each run a pool as
wide as the node, and the spinning workers of one engine take the cores the other engine's
Python thread needs (issue 33 item 6: P 37 s + D 46 s of CPU for a load the colocated
server served with 30 s).

`apply_thread_defaults` sets a short spin (SPINCOUNT, ~tens of microseconds: long enough to
bridge the gap between two ops of one forward pass, so a lone engine loses nothing, short
enough that an idle worker sleeps while its engine runs Python or waits) unless the user
chose a wait policy of their own. It changes the environment, not torch: libgomp reads it
once, when it loads, so it must run before the process imports torch or before it spawns
the processes that will (the EngineCore and its tensor-parallel workers inherit it).
The thread count is left to torch: it already follows the cores this process may run on
(os.sched_getaffinity), and `taskset` is how a user splits a node between engines.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Any of these set by the user means they chose the wait behaviour themselves.
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPINCOUNT = "10000"


def apply_thread_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets the default spin count into `environ` (default os.environ) unless the user set
    any of USER_KNOBS; returns what it set ({} when nothing). Call from the main thread at
    start-up, before torch is imported or any model process is spawned."""
    env = os.environ if environ is None else environ
    if any(k in env for k in USER_KNOBS):
        return {}
    env["GOMP_SPINCOUNT"] = SPINCOUNT
    return {"GOMP_SPINCOUNT": SPINCOUNT}

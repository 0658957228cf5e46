"""`tollgate` with the edge's safeguard against a store that drops its connection removed: a
request's events that the store could not take are never sent again (api/recorder.py). The
network-fault test's safeguard-off twin runs its edge this way and must find what that loses."""

from __future__ import annotations

from api import recorder
from api.cli import main

if __name__ == "__main__":
    recorder.APPEND_RETRY_FOR_S = 0.0
    main()

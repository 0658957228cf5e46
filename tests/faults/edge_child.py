"""`tollgate` with two of the edge's safeguards removed, for the safeguard-off twins: a request's
events that the store could not take are never sent again (api/services/recorder.py), and an
answer's end — its final usage, `[DONE]`, a JSON body — is sent without waiting for its terminal
event to commit (issue 26, finding 3: "done only when durable"). The twins run their edge this way
and must find what that loses: answers a client holds complete, billed other than shown."""

from __future__ import annotations

from tollgate_llm.api.services import edge, recorder, relay
from tollgate_llm.cli import main


async def _not_waiting(ended: object) -> bool:
    return True


if __name__ == "__main__":
    recorder.APPEND_RETRY_FOR_S = 0.0
    # Where the edge (a JSON answer) and the relay (a stream) wait for the terminal event.
    edge.durable = relay.durable = _not_waiting  # type: ignore[assignment]
    main()

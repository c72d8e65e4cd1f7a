"""The CPU engine's delivery thread: hands every step's results to the requests' callbacks while the next step runs."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pipeline.cpu_runtime.engine")


def deliver_loop(engine: Any) -> None:
    """Deliver ``engine._out`` items until the ``None`` sentinel (:meth:`CpuEngine.shutdown` puts it last)."""
    while (item := engine._out.get()) is not None:
        deliver(engine, item)


def deliver(engine: Any, item: tuple) -> None:
    """One item of the scheduler's queue, under the request's lock and only while it is not done: ``("logits", seq,
    float32 [n, vocab])`` → ``on_context_logits``; ``("error", seq, message)`` → ``on_error`` (else ``on_tokens([],
    True)``), the request done; ``("tokens", seq, ids, finished)`` → ``on_tokens``. A callback that raises is logged
    and its request cancelled (a client callback must not kill the engine)."""
    kind, seq = item[0], item[1]
    with seq.lock:
        if seq.done:
            return
        try:
            if kind == "logits":
                return seq.on_context_logits(item[2])
            if kind == "error":
                seq.done = True
                if seq.on_error is not None:
                    seq.on_error(item[2])
                else:
                    seq.on_tokens([], True)
                return
            toks, fin = item[2], item[3]
            if fin:
                seq.done = True
            seq.on_tokens(toks, fin)
        except Exception:  # a client callback must not kill the engine
            log.exception("callback failed for %s; cancelling it", seq.rid)
            if not seq.done:
                seq.done = True
                with engine._cv:
                    if engine._requests.pop(seq.rid, None) is not None:
                        engine._cancels.append(seq)
                        engine._cv.notify()

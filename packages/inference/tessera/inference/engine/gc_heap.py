"""The cyclic garbage collector's view of a serving process: everything built at start is frozen.

A serving process holds hundreds of thousands of long-lived objects once started (torch, the
tokenizer, pydantic schemas, the app), and every object a step or a streamed token allocates
counts towards the next collection, whose older generations walk that whole heap again (its
share of the HTTP process's CPU while streaming: benchmarks/RESULTS.md). `gc.freeze()` moves what exists now to a permanent generation that
no collection visits (vLLM does the same after its start); garbage made later is collected as
before. Called by each serving process once, just before it starts serving, never by library code
(a test process that froze its heap would keep every later-dropped cycle of earlier objects).
"""

from __future__ import annotations

import atexit
import gc


def freeze_heap() -> None:
    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    # At exit the frozen objects go back to the collector, so they are finalized as before
    # (an extension that counts its live objects at exit, nanobind's, would report them leaked).
    atexit.register(gc.unfreeze)

"""Small utilities with no knowledge of messages or peers (the lowest layer above
``errors``/``config``/``info``): bounded memo sets (:mod:`.bounded`), multi-threaded
copies (:mod:`.copier`), page-aligned buffers (:mod:`.memory`), a length-prefixed pipe
between a parent and its child process (:mod:`.pipe`), process liveness
(:mod:`.procs`)."""

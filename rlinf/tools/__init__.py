"""Command-line tools: ``rlinf`` (:mod:`.cli`: manager, top, bench, demo), the live view
(:mod:`.top`) and the benchmark runner (:mod:`.bench`). The top layer: nothing in rlinf
imports it."""

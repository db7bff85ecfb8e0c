"""Step memory: the peak bytes of one training step on each rank, traced before launch
(``meshbind.step_memory``; ``meshbind check ... --memory``)."""

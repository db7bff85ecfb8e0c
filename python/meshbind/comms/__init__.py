"""Step collectives: every collective of one training step on each rank, by kind, mesh axes,
dtype, calls and bytes, traced before launch (``meshbind.step_comms``; ``meshbind check ... --comms``)."""

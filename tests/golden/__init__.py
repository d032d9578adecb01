"""Golden runs: tiny seeded runs of every kind of training, recorded and compared
(:mod:`tests.golden.runs`)."""

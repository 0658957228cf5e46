"""`tollgate router evaluate`: the router judged on generated traffic with a known ground truth,
replayed through the real admission (replay.py), against always the asked model and an oracle."""

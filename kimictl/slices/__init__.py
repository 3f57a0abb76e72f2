"""The slice wing: what a slice of a P/D deployment is (model.py), the engine probes a change to one takes (probes.py),
and the steps `kimictl rollout` and `kimictl heal` share (steps.py)."""

"""Side-by-side benchmarks: every arm measured in the same run, arm order rotated per pass."""

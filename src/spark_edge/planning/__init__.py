"""Memory planning: what a model on a weight path will hold, and what fits under the ceiling."""

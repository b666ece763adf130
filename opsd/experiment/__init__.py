"""Experiments: recipes x seeds under the capped budget, scored alike, with a paired verdict."""

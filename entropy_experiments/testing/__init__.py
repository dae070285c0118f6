"""Small, fully offline models and helpers for tests and dry runs."""

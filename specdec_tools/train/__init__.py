"""Self-distillation trainers of drafters (``specdec train ...``) on the frozen target's features, cached by data.py."""

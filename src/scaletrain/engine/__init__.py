"""The training loop and what it needs: optimizer, LR schedule, evaluation, weights."""

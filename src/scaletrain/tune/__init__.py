"""`scaletrain tune`: a hyperparameter search on Ray Tune, every trial a full scaletrain job.

space reads and checks the search space file; search runs the trials and picks the best.
Ray is imported only when a search starts (the `ray` extra).
"""

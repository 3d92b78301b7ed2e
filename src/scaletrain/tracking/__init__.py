"""What a run reports: metrics files, JSON logs, the console progress bar."""

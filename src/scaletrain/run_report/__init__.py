"""`scaletrain report`: one self-contained HTML page (and its PNGs) for a run or a tune search,
from what the tracking store holds: metric histories, the run card, the logs and telemetry."""

"""The experiment scripts and the measuring tools they share (run as `python experiments/X.py`)."""

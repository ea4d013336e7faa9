"""A run's records: the trial store, the run directory, its metadata, trial results and atomic files."""

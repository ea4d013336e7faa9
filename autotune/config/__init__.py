"""The typed config every entry point reads: the run's sections, the search's, and defaults for a bare model."""

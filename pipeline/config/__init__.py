"""A run's configuration: its schema, how it is read and checked, addresses."""

"""What a run records: the record and summary, memory, the trace, the step's critical breakdown."""

"""What operators change at run time and how it is seen: the configuration version and its
cache, feature switches, the audit log, and the database notifications every layer sends
(`notify.py`)."""

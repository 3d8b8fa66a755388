"""What operators change at run time and how it is seen: the configuration version and its
cache, feature switches, change notifications and the audit log."""

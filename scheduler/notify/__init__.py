"""Between processes: the database notification channels (sent after commit), the listener
that wakes workers and live views, and streamed output over the channel layer."""

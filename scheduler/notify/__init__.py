"""Between processes: the listener that hears the database's notifications for the worker, live
views and the gateway (`listener.py`; the channels and their senders are in
telemachus/control/notify.py, where every layer can reach them), and streamed output
(`broadcast.py`)."""

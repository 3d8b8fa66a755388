from django.apps import AppConfig


class TelemachusConfig(AppConfig):
    """The project package doubles as the app that owns teams and RBAC, which every other app uses."""

    name = "telemachus"
    verbose_name = "Teams"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from telemachus.teams import signin  # noqa: F401  (connects the sign-in counting signals)
        from telemachus.timestamps import timestamps_fast

        connection_created.connect(timestamps_fast, dispatch_uid="telemachus.timestamps")

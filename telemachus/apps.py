from django.apps import AppConfig


class TelemachusConfig(AppConfig):
    """The project package doubles as the app that owns teams and RBAC, which every other app uses."""

    name = "telemachus"
    verbose_name = "Teams"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from telemachus.db.internals import query_conversion_cached
        from telemachus.db.timestamps import timestamps_fast
        from telemachus.teams import signin  # noqa: F401  (connects the sign-in counting signals)

        connection_created.connect(timestamps_fast, dispatch_uid="telemachus.db.timestamps")
        # The submit's and the claim's statements are long, with many parameters: each is
        # converted once per process, not once per execute.
        query_conversion_cached(length=32_768, params=256)

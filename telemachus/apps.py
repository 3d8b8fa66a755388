from django.apps import AppConfig


class TelemachusConfig(AppConfig):
    """The project package doubles as the app that owns teams and RBAC, which every other app uses."""

    name = "telemachus"
    verbose_name = "Teams"

    def ready(self) -> None:
        from telemachus.teams import signin  # noqa: F401  (connects the sign-in counting signals)

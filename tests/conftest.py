import itertools

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import connection
from rest_framework.test import APIClient

from executors.health import last_seen_stamps_forget
from executors.models import Executor
from telemachus.control.config import config_cache_clear
from telemachus.models import Team
from telemachus.teams import rbac
from telemachus.teams.services import team_create, team_member_set
from tests.credentials import token_for
from tests.processes import Processes

_names = itertools.count(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked `postgres` prove things about locking and concurrency that SQLite cannot;
    they are skipped, loudly, when the suite runs on SQLite."""
    from django.conf import settings

    if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL (set DATABASE_URL=postgres://...)")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_configuration_cache():
    """Each test starts with nothing cached: its database may repeat a configuration version that
    an earlier test's (rolled back or flushed) database had, with other rows behind it."""
    config_cache_clear()
    yield
    config_cache_clear()


@pytest.fixture(autouse=True)
def fresh_last_seen_stamps():
    """Executors' `last_seen` stamps (executors/health.py) do not carry from one test to the next,
    whose database may give a new executor an id an earlier test's had."""
    last_seen_stamps_forget()
    yield
    last_seen_stamps_forget()


@pytest.fixture(autouse=True)
def fresh_cache():
    """Throttle and sign-in counts (Django's cache) do not carry from one test to the next."""
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def make_user(db):
    def make(username: str | None = None, **fields):
        username = username or f"user{next(_names)}"
        return get_user_model().objects.create_user(username=username, password="pw", **fields)

    return make


@pytest.fixture
def make_team(db):
    """Teams granting their members every job permission unless told otherwise (RBAC tests do)."""

    def make(slug: str | None = None, members: dict | None = None, grants=tuple(rbac.PERMISSIONS)) -> Team:
        team = team_create(slug=slug or f"team{next(_names)}", name="Team", grants=grants)
        for user, role in (members or {}).items():
            team_member_set(team=team, username=user.username, role=role)
        return team

    return make


@pytest.fixture
def make_executor(db):
    def make(name: str | None = None, models=("m",), kind="sim", **fields) -> Executor:
        fields.setdefault("max_concurrency", 4)
        fields.setdefault("meta", {"latency_ms": 0})
        return Executor.objects.create(
            name=name or f"exec{next(_names)}", kind=kind, capabilities={"models": list(models)}, **fields
        )

    return make


@pytest.fixture
def api():
    """An API client factory authenticating with a real DRF token, as apps do."""

    def client(user=None) -> APIClient:
        c = APIClient()
        if user is not None:
            c.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
        return c

    return client


@pytest.fixture
def operator(make_user):
    return make_user("operator", is_superuser=True, is_staff=True)


@pytest.fixture
def on_postgres() -> bool:
    return connection.vendor == "postgresql"


def chat_body(team: str, model: str = "m", **overrides) -> dict:
    body = {
        "type": "chat",
        "team": team,
        "priority": 0,
        "requirements": {"model": model, "est_tokens": 100},
        "input": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16},
    }
    body.update(overrides)
    return body


def backdate(job_id: int, age) -> None:
    """As if the job had been submitted (and queued, and ready) `age` (a timedelta) ago."""
    from django.utils import timezone

    from scheduler.models import Job

    then = timezone.now() - age
    Job.objects.filter(pk=job_id).update(submitted_at=then, ready_at=then, queued_at=then)


def job_body(team: str, type: str = "chat", **overrides) -> dict:
    """A valid submit body for each job type (a chat's, with the input that type needs)."""
    body = chat_body(team, type=type)
    if type == "translate":
        body["input"] = {"text": "Good morning", "target_lang": "French"}
    elif type == "tool":
        body["input"] = {"tool": "echo", "arguments": {"say": "hi"}}
        del body["requirements"]
    elif type == "flow":
        body["input"] = {"messages": [{"role": "user", "content": "hello"}]}
    body.update(overrides)
    return body


@pytest.fixture
def member_setup(make_user, make_team, make_executor):
    """Given alice in team a, bob in team b, and a shared executor offering model m."""
    alice, bob = make_user("alice"), make_user("bob")
    team_a = make_team("a", {alice: "member"})
    team_b = make_team("b", {bob: "member"})
    executor = make_executor("shared", models=["m"])
    return alice, bob, team_a, team_b, executor


@pytest.fixture
def processes(tmp_path):
    """Start real processes (workers, model servers) for one test; none outlives it."""
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()

"""Who may use which executor is one rule (executors.selectors.executor_serves): the API's
executors_usable_by, the model list's models_usable_by, the submit's cached configuration and the
queue snapshot must agree on every team."""

from django.utils import timezone
from guardian.shortcuts import assign_perm

from executors.selectors import executors_usable_by, models_usable_by
from scheduler.core.configuration import configuration
from scheduler.live.snapshot import Cluster
from telemachus.control.config import config_snapshot


def test_every_reader_agrees_on_usable_executors(make_team, make_executor):
    owner, granted, other = make_team("owner"), make_team("granted"), make_team("other")
    make_executor("shared", models=("s",))
    owned = make_executor("owned", models=("o",), team=owner)
    make_executor("owned-off", models=("x",), team=owner, enabled=False)
    make_executor("other-box", models=("p",), team=other)
    assign_perm("executors.use_executor", granted.group, owned)

    expected = {owner.pk: {"s", "o"}, granted.pk: {"s", "o"}, other.pk: {"s", "p"}}
    assert models_usable_by(expected) == expected
    conf = configuration(config_snapshot())
    cluster = Cluster.load(now=timezone.now())
    for team_id, models in expected.items():
        assert {m for e in executors_usable_by(team=team_id) for m in e.offered_models} == models
        for model in ("s", "o", "p", "x"):
            by_api = {e.name for e in executors_usable_by(team=team_id, model=model)}
            assert {e.name for e in conf.executors_usable_by(team_id=team_id, model=model)} == by_api
            assert {
                e.name
                for e in cluster.executors
                if e.enabled and model in e.offered_models and cluster.usable_by(e, team_id)
            } == by_api

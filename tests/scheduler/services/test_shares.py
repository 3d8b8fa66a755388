"""Fair-share usage: decayed to the moment of each charge, charged in one statement."""

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler.models import TeamShare
from scheduler.services.shares import team_shares_charge

pytestmark = pytest.mark.django_db


def usage(team) -> float:
    return TeamShare.objects.get(team=team).usage


def test_a_first_charge_creates_the_row(make_team):
    team = make_team("a")
    now = timezone.now()
    team_shares_charge(charges={team.pk: 2.5}, now=now, half_life=60)
    share = TeamShare.objects.get(team=team)
    assert share.usage == 2.5 and share.updated_at == now


def test_what_was_there_decays_before_the_charge(make_team):
    # Given 8 slot-seconds of usage as of two half-lives ago...
    a, b = make_team("a"), make_team("b")
    now = timezone.now()
    TeamShare.objects.create(team=a, usage=8.0, updated_at=now - timedelta(seconds=120))
    TeamShare.objects.create(team=b, usage=1.0, updated_at=now)

    # When both teams are charged 1 now...
    team_shares_charge(charges={b.pk: 1.0, a.pk: 1.0}, now=now, half_life=60)

    # Then a's usage decayed to a quarter first, as TeamShare.decayed reads it.
    assert usage(a) == pytest.approx(8.0 / 4 + 1.0)
    assert usage(b) == pytest.approx(2.0)
    assert TeamShare.objects.get(team=a).updated_at == now


def test_a_settlement_never_takes_usage_below_zero(make_team):
    a, b = make_team("a"), make_team("b")
    now = timezone.now()
    TeamShare.objects.create(team=a, usage=0.5, updated_at=now)
    team_shares_charge(charges={a.pk: -2.0, b.pk: -1.0}, now=now, half_life=60)
    assert usage(a) == 0.0 and usage(b) == 0.0


def test_a_late_charge_keeps_the_newer_time(make_team):
    # A finish whose clock read came before a claim's commit must not move the row back in time.
    team = make_team("a")
    now = timezone.now()
    TeamShare.objects.create(team=team, usage=4.0, updated_at=now)
    team_shares_charge(charges={team.pk: 1.0}, now=now - timedelta(seconds=5), half_life=60)
    share = TeamShare.objects.get(team=team)
    assert share.usage == pytest.approx(5.0) and share.updated_at == now


def test_no_half_life_forgets_the_past(make_team):
    team = make_team("a")
    now = timezone.now()
    TeamShare.objects.create(team=team, usage=9.0, updated_at=now)
    team_shares_charge(charges={team.pk: 1.0}, now=now, half_life=0)
    assert usage(team) == 1.0

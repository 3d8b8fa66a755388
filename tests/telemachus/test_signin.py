"""Sign-in attempts on the admin and the dashboard are limited per username at an address and per
address: 429 with Retry-After, before the password is even checked, until the window ends. A
username's failures from anywhere only slow attempts on it: nobody can lock its owner out."""

import time

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db

FORMS = ["/admin/login/", "/login/"]


def sign_in(client: Client, path: str, username: str, password: str):
    return client.post(path, {"username": username, "password": password})


@pytest.fixture(autouse=True)
def quick_slowdown(settings):
    """Attempts on a username slowed by its failures wait tenths of seconds here, not seconds."""
    settings.TELEMACHUS_LOGIN_SLOWDOWN_SECONDS, settings.TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS = 0.05, 0.2


@pytest.fixture
def staff(make_user):
    return make_user("root", is_superuser=True, is_staff=True)


@pytest.mark.parametrize("path", FORMS)
def test_thirty_wrong_passwords_meet_a_429(staff, path):
    # Given an attacker guessing root's password from one address...
    attacker = Client(REMOTE_ADDR="203.0.113.7")
    statuses = [sign_in(attacker, path, "root", f"guess{i}").status_code for i in range(30)]

    # Then the first five are wrong-password forms and the rest are refused outright...
    assert statuses[:5] == [200] * 5 and set(statuses[5:]) == {429}
    refused = sign_in(attacker, path, "root", "pw")
    assert refused.status_code == 429 and 800 <= int(refused["Retry-After"]) <= 900
    # ...even with the right password, from that address.


@pytest.mark.parametrize("path", FORMS)
def test_one_address_trying_many_usernames_is_limited(make_user, path):
    make_user("someone")
    spray = Client(REMOTE_ADDR="203.0.113.9")
    statuses = [sign_in(spray, path, f"user{i}", "password1").status_code for i in range(25)]
    assert statuses[:20] == [200] * 20 and set(statuses[20:]) == {429}
    # Another address signs in as usual.
    assert sign_in(Client(REMOTE_ADDR="198.51.100.2"), "/login/", "someone", "pw").status_code == 302


def test_a_good_sign_in_clears_its_username(make_user):
    make_user("alice")
    browser = Client(REMOTE_ADDR="192.0.2.1")
    for _ in range(4):
        assert sign_in(browser, "/login/", "alice", "wrong").status_code == 200
    assert sign_in(browser, "/login/", "alice", "pw").status_code == 302
    for _ in range(4):
        assert sign_in(Client(REMOTE_ADDR="192.0.2.1"), "/login/", "alice", "wrong").status_code == 200


@override_settings(TELEMACHUS_LOGIN_WINDOW_SECONDS=1)
def test_the_window_ends(make_user):
    make_user("alice")
    browser = Client(REMOTE_ADDR="192.0.2.5")
    for _ in range(5):
        sign_in(browser, "/login/", "alice", "wrong")
    assert sign_in(browser, "/login/", "alice", "pw").status_code == 429
    time.sleep(1.2)
    assert sign_in(browser, "/login/", "alice", "pw").status_code == 302


@override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"))
def test_behind_a_proxy_the_proxy_seen_address_counts_not_the_clients_claim(make_user):
    make_user("alice")
    for i in range(20):
        forged = Client(REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR=f"1.2.3.{i}, 203.0.113.50")
        sign_in(forged, "/login/", f"u{i}", "wrong")
    blocked = Client(REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR="9.9.9.9, 203.0.113.50")
    assert sign_in(blocked, "/login/", "alice", "pw").status_code == 429
    other = Client(REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.51")
    assert sign_in(other, "/login/", "alice", "pw").status_code == 302


@pytest.mark.parametrize("path", FORMS)
def test_failures_elsewhere_never_lock_the_owner_out(staff, path):
    # Given five (and more) wrong passwords for root from an attacker's address...
    attacker = Client(REMOTE_ADDR="203.0.113.7")
    for i in range(8):
        sign_in(attacker, path, "root", f"guess{i}")
    assert sign_in(attacker, path, "root", "pw").status_code == 429
    # ...root, from their own address, still signs in on both forms.
    assert sign_in(Client(REMOTE_ADDR="198.51.100.1"), path, "root", "pw").status_code == 302
    assert sign_in(Client(REMOTE_ADDR="198.51.100.1"), "/login/", "root", "pw").status_code == 302


def test_a_username_failing_from_many_addresses_is_slowed_not_locked(settings, make_user):
    settings.TELEMACHUS_LOGIN_SLOWDOWN_SECONDS, settings.TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS = 0.2, 0.4

    def timed(address: str, password: str) -> tuple[int, float]:
        started = time.monotonic()
        status = sign_in(Client(REMOTE_ADDR=address), "/login/", "alice", password).status_code
        return status, time.monotonic() - started

    make_user("alice")
    # Given a guess for alice from each of five addresses (none over its own limits), answered at once...
    quick = [timed(f"203.0.113.{i}", "wrong") for i in range(5)]
    assert [status for status, _ in quick] == [200] * 5 and max(t for _, t in quick) < 0.2
    # ...the next attempts on alice wait, longer with each failure, up to the cap...
    slowed = [timed(f"198.51.100.{i}", "wrong") for i in range(3)]
    assert [status for status, _ in slowed] == [200] * 3
    assert 0.2 <= slowed[0][1] and 0.4 <= slowed[1][1] and 0.4 <= slowed[2][1] < 1.0
    # ...and alice herself waits too, but gets in.
    status, took = timed("192.0.2.77", "pw")
    assert status == 302 and took >= 0.4

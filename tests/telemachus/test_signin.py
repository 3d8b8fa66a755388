"""Sign-in attempts on the admin and the dashboard are limited per username and per address: 429
with Retry-After, before the password is even checked, until the window ends."""

import time

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db

FORMS = ["/admin/login/", "/login/"]


def sign_in(client: Client, path: str, username: str, password: str):
    return client.post(path, {"username": username, "password": password})


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
    # ...even with the right password, and from another address too (the username is limited).
    assert sign_in(Client(REMOTE_ADDR="198.51.100.1"), path, "root", "pw").status_code == 429


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

"""The site's icon: a small SVG of its own (no CDN), at /favicon.ico for anyone who asks the
conventional path (the admin and API pages link none), and the one the sign-in page links."""

import re
import xml.etree.ElementTree as ET

import pytest
from django.contrib.staticfiles import finders


def test_favicon_ico_is_the_sites_svg(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/svg+xml"
    body = response.content
    assert body == open(finders.find("scheduler/favicon.svg"), "rb").read()
    assert len(body) < 2048 and ET.fromstring(body).tag == "{http://www.w3.org/2000/svg}svg"
    assert not re.search(rb"(href|src)=", body), "self-contained: nothing fetched from elsewhere"


@pytest.mark.django_db
def test_the_sign_in_page_links_an_icon_served_here(client):
    page = client.get("/login/").content.decode()
    (href,) = re.findall(r'<link rel="icon" href="([^"]+)"', page)
    assert href.startswith("/") and not href.startswith("//")
    icon = client.get(href)
    assert icon.status_code == 200 and b"<svg" in b"".join(icon.streaming_content if icon.streaming else [icon.content])
